"""The run layer: a workflow's settings (config), its results folder (results), the folder's writer lock (locks),
secrets kept out of its records (redaction), one lifecycle that every workflow goes through (lifecycle),
checkpoints, what a run survives (faults), launching (launch), the Trainer callbacks that record memory and metrics
(callbacks), and the command-line wrapper (cli). It builds on the core layer only.
"""
