"""The tools behind ``python -m my_utils <command>``: compare, plan, sweep, env, demo, bench. They read and write
results folders through the run layer; no lesson depends on them.
"""
