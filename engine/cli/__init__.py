"""The command lines, ``python -m engine.cli.<tool>``: generate, bench, bench_gpu, bench_trees,
bench_multiturn, calibrate, profile, step_profile. Shared options live in :mod:`.arguments`.
Only command lines (these and ``launch.py``) import from here."""
