"""labrun's optional tools: what a project calls now and then, never what every run needs.

    gpucheck    `python -m labrun.gpucheck`: run.py's own step against each GPU claim
    reference   the hand-written loops gpucheck and benchmarks/bench_reference.py compare with
    tuning      run.py's --find-lr, --find-batch-size and --profile (imported when asked for)
    similarity  linear CKA between two models' layers (analyze.py)
    ddpscaling  DDP's step time on 1 and N processes (gpucheck's ddp check, bench_ddp.py)

The core (every labrun module outside this package) never imports them at module level
(lib/tests/test_imports.py): a training run loads none of this code.
"""
