"""Preparation tools: what one method needs before its training run, each a command of ``flowalign prep``.

* ``calibrate`` (DenseGRPO): per-step noise levels, written as a config for ``flowalign train``
  (``flowalign prep calibrate``);
* ``fit_manifold`` (Shell-LCC): the data manifold on the model's VAE latents (``flowalign prep fit-manifold``);
* ``train_discriminator`` (DRL): the discriminator reward between data images and the base model's samples
  (``flowalign prep train-discriminator``);
* ``train_registers`` (Register-GRPO, RGS): latent reward registers on the model's own samples
  (``flowalign prep registers``).

Each writes a file that a config then names; none is part of the training loop (``flowalign.training``). This package
may import ``flowalign.training`` (calibration samples with the trainer's parts); ``flowalign.training`` never imports
it.
"""
