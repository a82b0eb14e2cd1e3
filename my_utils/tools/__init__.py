"""The tools behind ``python -m my_utils <command>``: compare, plan, sweep, env, demo, bench. They read and write
results folders through the run layer. Lessons use them as a learner would (lesson 07 sweeps, lesson 14 compares and
plans); no workflow imports them (tests/test_import_hygiene.py).
"""
