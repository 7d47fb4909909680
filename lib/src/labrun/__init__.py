"""labrun: the machinery of the lab's deep-learning projects, so that a project keeps its method.

A project's run.py holds the method (data, model, optimizer, the step, the loop); labrun holds
what is the same in every project: the run directory and its identity, the claim, checkpoints and
exact resume, stop signals, MLflow tracking, the sweep engine and Slurm, the data layer, the
device / precision / compile policy, torchrun, results tables and gpucheck. Importing labrun
imports no torch: `--help` stays instant.
"""

__version__ = "0.1.0"
