"""The Monitor inside training frameworks: a Lightning ``Callback`` and a Hugging Face ``TrainerCallback``.

Import the one you use; each needs its framework (``pip install 'stabstudy[lightning]'`` or
``'stabstudy[hf]'``), and importing this package loads neither:

* :class:`stabstudy.instruments.integrations.lightning.LightningTelemetryCallback`
* :class:`stabstudy.instruments.integrations.hf.HFTelemetryCallback`

Both attach a :class:`~stabstudy.instruments.telemetry.Monitor` to the optimizer the framework
built, put the latest update's channels into the framework's own logs as ``stability/<channel>``,
carry the recorded rows through the framework's checkpoints (:mod:`.segments`) and give the whole
run as the Monitor's xarray Dataset (``callback.dataset()``).
"""
