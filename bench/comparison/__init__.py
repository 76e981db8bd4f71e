"""bench/compare as a package: the entry point bench/compare bootstraps and calls main.main().

bootstrap.py    build the CLI and the Python package from a snapshot, the venv, the peers' pips
main.py         the command line; which of bootstrap, orchestrator, worker, memprobe runs
orchestrate.py  the run: peers available, arithmetic limits, a worker per point, results
points.py       the presets, the target table's points, the sweep; the inputs of a point;
                the decode points
worker.py       one point in a fresh process: set up, warm up, cross-check, timed rounds
decode.py       --decode: one decode point in a fresh process (the CLI's decode kernel, torch)
decode_run.py   --decode: the bandwidth, a worker per decode point, the decode results
peers/          the implementations timed in the worker, a file per framework; cli.py: the
                flashcte CLI's sgemm and materialized
tolerance.py    the cross-checks' tolerances, derived as tests/test_util.cc derives its own
memory.py       peak-RSS probes
machine.py      the cores' arithmetic limits, the read bandwidth, the CPU, the versions
report.py       results.csv, results.md, the target table
plots.py        plots/*.png
"""
