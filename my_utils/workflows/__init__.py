"""One module per lesson. Each has ``train(cfg) -> summary`` (launchable by ``notebook_launcher``) and
``main(argv)`` (for ``accelerate launch -m my_utils.workflows.<name>`` or ``torchrun -m``)."""
