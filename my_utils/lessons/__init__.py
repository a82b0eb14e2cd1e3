"""The lessons layer: what a lesson computes from its results folders, one module per lesson or concern: notebook (a
lesson's folder and its checked claims), rank_sweep (lesson 07's sentences, tables and plots, and the report the
sweep command prints), classification (lesson 11's table), peft_methods (lesson 13's comparison), levers (lesson
15's training loops, one lever each). It sits above every other layer and nothing imports it but the course's
command line (``python -m my_utils sweep``), notebooks, scripts and tests.
"""
