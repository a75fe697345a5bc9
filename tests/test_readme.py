"""The README says what the code does: its tag table and its notebook list are checked against the code."""

from __future__ import annotations

import ast
import inspect
import math
import re
from pathlib import Path

import pytest
from lightning.pytorch.loggers import TensorBoardLogger

from lightning_mp import MixedPrecision
from lightning_mp.callbacks import (
    AdvisorCallback,
    GradientHealthMonitor,
    LayerDtypeMonitor,
    LossScaleMonitor,
    PrecisionSentinel,
)
from tests.helpers import TinyRegressor, loader, make_trainer, read_events

ROOT = Path(__file__).parents[1]
README = (ROOT / "README.md").read_text()


def readme_table(header: str) -> list[list[str]]:
    """The cells of the Markdown table under the header row that starts with ``header``."""
    lines = README.splitlines()
    start = next(index for index, line in enumerate(lines) if line.startswith(header))
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in re.split(r"(?<!\\)\|", line)[1:-1]])
    return rows


def readme_tags() -> dict[str, set[str]]:
    """The TensorBoard tags the README lists, by the kind of event TensorBoard files them under."""
    tags: dict[str, set[str]] = {"scalars": set(), "tensors": set(), "histograms": set(), "images": set()}
    for _, tag_cell, _ in readme_table("| callback | tag |"):
        kind = "tensors" if "(text)" in tag_cell else "histograms" if "(histogram)" in tag_cell else "scalars"
        kind = "images" if "(image)" in tag_cell else kind
        tags[kind].update(re.findall(r"`([^`]+)`", tag_cell))
    return tags


def test_every_tensorboard_tag_the_readme_lists_is_what_a_real_run_writes(tmp_path: Path) -> None:
    """A user who looks for a README tag in TensorBoard finds it under that name, and every written tag is listed."""
    logger = TensorBoardLogger(tmp_path)
    callbacks = [
        AdvisorCallback(batches=1),
        LossScaleMonitor(),
        GradientHealthMonitor(),
        LayerDtypeMonitor(),
        PrecisionSentinel(every_n_steps=1),
    ]
    trainer = make_trainer(
        MixedPrecision("16-mixed", init_scale=2.0**8, growth_interval=1),
        callbacks=callbacks,
        logger=logger,
        log_every_n_steps=1,
        max_steps=3,
    )
    # An overflow at step 1 writes the overflow text; growth_interval=1 grows the scale on the clean steps.
    with pytest.warns(RuntimeWarning, match="first.weight"):
        trainer.fit(TinyRegressor(inject_at=(1,)), loader(batch_size=4))
    written = read_events(logger.log_dir).Tags()
    listed = readme_tags()
    dtype_tag = "precision/layers/<dtype>"
    assert dtype_tag in listed["scalars"]
    per_dtype = {tag for tag in written["scalars"] if re.fullmatch(r"precision/layers/\w+", tag)}
    assert per_dtype, "no precision/layers/<dtype> scalar was written"
    # Lightning's own scalars (epoch) are not the package's.
    ours = {tag for tag in written["scalars"] if tag.startswith("precision")} - per_dtype
    assert ours == listed["scalars"] - {dtype_tag}
    for kind in ("tensors", "histograms", "images"):
        assert set(written[kind]) == listed[kind], kind


def test_the_readme_lists_every_notebook_and_its_commands_name_them_all() -> None:
    """The notebook table names each notebook in notebooks/, and the top of the README says how many CI runs."""
    on_disk = sorted(path.relative_to(ROOT).as_posix() for path in (ROOT / "notebooks").glob("*.ipynb"))
    listed = sorted(re.findall(r"`([^`]+\.ipynb)`", " ".join(row[0] for row in readme_table("| notebook |"))))
    assert listed == on_disk
    counts = {3: "three", 4: "four", 5: "five", 6: "six"}
    assert f"executes the {counts[len(on_disk)]} notebooks" in " ".join(README.split())


def test_the_readme_knob_table_gives_the_defaults_the_plugin_uses() -> None:
    """Each default in the README's table of scaler knobs is what MixedPrecision("16-mixed") really uses."""
    plugin = MixedPrecision("16-mixed")
    plugin.setup_for_device("cpu")
    scaler = plugin.scaler
    assert scaler is not None
    effective = {
        "init_scale": scaler.get_scale(),
        "growth_factor": scaler.get_growth_factor(),
        "backoff_factor": scaler.get_backoff_factor(),
        "growth_interval": scaler.get_growth_interval(),
    }
    signature = inspect.signature(MixedPrecision.__init__).parameters
    rows = readme_table("| argument | default | allowed | meaning |")
    assert len(rows) == 13
    for argument_cell, default_cell, _, _ in rows:
        argument = argument_cell.strip("`")
        documented = ast.literal_eval(default_cell.strip("`").replace("2**16", "65536").replace("2**24", "16777216"))
        actual = effective.get(argument, signature[argument].default)
        assert documented == actual, argument


def readme_number(text: str) -> float:
    """A bound as the knob table writes it: ``2**-24``, ``2147483647``, ``3.4028234663852886e+38``, or the default
    of another knob that bounds this one (``min_scale`` is the floor ``2**-24``, ``max_scale`` its default)."""
    defaults = {"min_scale": 2.0**-24, "max_scale": 2.0**24}
    if text in defaults:
        return defaults[text]
    power = re.fullmatch(r"2\*\*(-?\d+)", text)
    return 2.0 ** int(power.group(1)) if power else ast.literal_eval(text)


def plugin_with(argument: str, value: float) -> MixedPrecision:
    """``MixedPrecision("16-mixed", argument=value)``, with the first scale moved inside a probed ``min_scale`` or
    ``max_scale`` (it must lie in ``[min_scale, max_scale]``)."""
    room = {
        "min_scale": {"init_scale": min(max(value, 2.0**16), 2.0**24)},
        "max_scale": {"init_scale": min(value, 2.0**16)},
    }
    return MixedPrecision("16-mixed", **{argument: value, **room.get(argument, {})})


def test_the_readme_knob_table_gives_the_bounds_the_plugin_enforces() -> None:
    """Each bound in the README's "allowed" column is exact: the bound is accepted (or refused, if strict) and the
    next number past it is refused with a ValueError that prints the bound as the README does."""
    probes = 0
    for argument_cell, _, allowed_cell, _ in readme_table("| argument | default | allowed | meaning |"):
        argument = argument_cell.strip("`")
        integer = "an integer" in allowed_cell
        for low, low_op, high_op, high in re.findall(r"`(\S+) (<=?) x (<=?) (\S+)`", allowed_cell):
            bounds = [(low, low_op, -1), (high, high_op, +1)]
            for text, op, outward in bounds:
                bound = readme_number(text)
                past = bound + outward if integer else math.nextafter(bound, outward * math.inf)
                inside = bound - outward if integer else math.nextafter(bound, -outward * math.inf)
                accepted, refused = (bound, past) if op == "<=" else (inside, bound)
                plugin_with(argument, int(accepted) if integer else accepted)
                message = rf"{argument}=.* not allowed: .*{re.escape(text) if text[0].isdigit() else ''}"
                with pytest.raises(ValueError, match=message):
                    plugin_with(argument, int(refused) if integer else refused)
                probes += 1
        for op, text in re.findall(r"`x (>) (\S+)`", allowed_cell):
            bound = readme_number(text)
            MixedPrecision("16-mixed", **{argument: math.nextafter(bound, math.inf)})
            with pytest.raises(ValueError, match=rf"{argument}=.* must be a finite number {op} {re.escape(text)}"):
                MixedPrecision("16-mixed", **{argument: bound})
            probes += 1
    assert probes == 17
