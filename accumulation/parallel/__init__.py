"""More than one rank: this rank's context (distributed.py); the process group, the D x P layout and the step's
strategies, each imported only when the launch or the config asks for it (README.md, "Layout"). They may import
the maths, config/, models/ and data/, never run/."""
