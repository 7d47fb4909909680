"""`python -m labrun.gpucheck`: the command every project's README gives to prove the GPU claims.

The check is an optional tool, labrun.tools.gpucheck; this file only runs it, so that command
keeps its name while the core imports no tool (importing this module does nothing)."""

if __name__ == "__main__":
    import sys

    from labrun.tools.gpucheck import main

    sys.exit(main())
