"""The tools behind ``python -m my_utils <command>``: compare, plan, sweep, env, demo, bench, gpucheck, cluster. They
read and write results folders through the run layer. Lessons use them as a learner would: sweeps in lessons 06, 07
and 13, the planner in 06, 08, 09 and 14, compare in 14, the environment report in 00; no workflow imports them
(tests/test_import_hygiene.py), and what a lesson computes from their results is the lessons layer above them.
"""
