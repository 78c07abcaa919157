"""The train/validation split a job runs under, and what a resume keeps of it
(docs/validation.md, "What is held out").

A checkpoint's manifest records the split (`data_split`): the fraction of data.source's
documents training never read (`held_out_fraction`, 0: all of them) and the validation
set scored (`eval_source`, `eval_samples`; "" and 0 when nothing was). A resume keeps
both: training goes on skipping the documents held out, whether this job evaluates or
not, and a job that evaluates must score the set the checkpoint scored. A resume that
would change either is refused, naming each field with both values (never adopted
silently: the config a user resumes with is the one they see in its output).

Worked example: a checkpoint saved with eval.every=2, eval.samples=8, eval.fraction=0.05
records {held_out_fraction: 0.05, eval_source: "", eval_samples: 8}.
  - resumed with eval.every=0: trains on the same 95% and does not evaluate; its own
    checkpoints record the same split, so a later resume with evaluation on still may;
  - resumed with eval.every=4, eval.samples=8, eval.fraction=0.05: the same split and set;
  - resumed with eval.fraction=0.1 or eval.samples=16 or eval.source="v.bin": refused.
A checkpoint of a job that held nothing out (evaluation off, or on eval.source) cannot be
resumed with a held-out split: documents it trained on would become its validation set.
"""

from __future__ import annotations

NO_SPLIT = {"held_out_fraction": 0.0, "eval_source": "", "eval_samples": 0}
"""What a manifest without `data_split` (older than [eval]) trained under."""


class SplitChanged(ValueError):
    """A resume would change the checkpoint's split or validation set."""


def job_split(config) -> dict:
    """The split a new job runs under (and its manifests record)."""
    e = config.eval
    return {"held_out_fraction": e.held_out, "eval_source": e.source if e.enabled else "",
            "eval_samples": e.samples if e.enabled else 0}


def resumed_split(saved: dict | None, config, where: str) -> dict:
    """The split a job resuming from a checkpoint whose manifest recorded `saved` runs
    under: the checkpoint's (module docstring). Raises SplitChanged naming every field
    this job's [eval] would change."""
    saved = dict(NO_SPLIT, **(saved or {}))
    if not config.eval.enabled:
        return saved  # the split kept, and the set carried for a later resume that evaluates
    mine, changed = job_split(config), []
    if saved["eval_samples"]:  # the checkpoint scored a set: this job scores the same
        for field, key in (("eval.source", "eval_source"), ("eval.samples", "eval_samples")):
            if mine[key] != saved[key]:
                changed.append(f"{field}={mine[key]!r} here, {saved[key]!r} in the checkpoint")
    if mine["held_out_fraction"] != saved["held_out_fraction"]:
        changed.append(f"eval.fraction: {_held(mine['held_out_fraction'])} here, "
                       f"{_held(saved['held_out_fraction'])} in the checkpoint")
    if changed:
        raise SplitChanged(
            f"checkpoint.resume={where!r}: a resume keeps the checkpoint's train/validation split and "
            f"validation set, and this job's [eval] changes them ({'; '.join(changed)}): resume with the "
            f"checkpoint's values, or with eval.every=0 (training then still skips its held-out documents)")
    return mine  # the checkpoint's split; its set, or (it scored none) this job's


def _held(fraction: float) -> str:
    return f"{fraction} of data.source held out" if fraction else "nothing held out"
