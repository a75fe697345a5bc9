"""Train the reference transformer from a LightningCLI YAML file: ``python examples/cli.py fit --config FILE``.

``examples/cli_config.yaml`` passes :class:`~lightning_mp.MixedPrecision` as ``trainer.plugins`` (``class_path`` and
``init_args``) and attaches the three monitors under ``trainer.callbacks``. Any value can be overridden on the
command line, for example ``--trainer.max_steps 50`` or ``--trainer.plugins.init_args.precision bf16-mixed``.
"""

from lightning.pytorch.cli import LightningCLI

from lightning_mp.tasks import MarkovTextDataModule, TinyTransformerLM


def main() -> None:
    LightningCLI(TinyTransformerLM, MarkovTextDataModule)


if __name__ == "__main__":
    main()
