"""Lab Project.

A deep-learning research project: one fast training job, a GPU-filling sweep, paper-ready
figures.
"""

__version__ = "0.1.0"
