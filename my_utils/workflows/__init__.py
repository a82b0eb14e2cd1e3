"""The workflows layer: one module per technique (a lesson may use several, and lesson 12's traps are one), plus what
several of them share (``ddp_common``, ``accelerate_steps/common``). Each technique has ``train(cfg) -> summary``
(launchable by ``notebook_launcher``) and ``main(argv)`` (for ``accelerate launch -m my_utils.workflows.<name>`` or
``torchrun -m``)."""
