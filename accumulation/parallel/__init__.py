"""More than one rank: this rank's context (distributed.py), the process group under torchrun (torchrun.py), the
D x P layout of replicas and pipeline stages (mesh.py), and the strategies the one step (accumulation/step.py) runs
for FSDP2 sharding (fsdp.py) and pipeline stages (pipeline.py), each imported only when the launch or the config
asks for it. They may import the maths, config/, models/ and data/, never run/."""
