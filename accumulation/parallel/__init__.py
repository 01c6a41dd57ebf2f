"""More than one rank: the process group and rank bookkeeping (distributed.py), the D x P layout of replicas and
pipeline stages (mesh.py), FSDP2 sharding (fsdp.py) and the pipelined step (pipeline.py). They may import the maths,
config/, models/ and data/, never run/."""
