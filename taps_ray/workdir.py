"""The layout of a study's work directory: every path a stage writes or reads under `work_dir`.

    <work_dir>/data.json                         the data stage's corpus and mixture counts
    <work_dir>/features/<mixture>-<key>/         target features of one training mixture
    <work_dir>/heads/<kind>-<mixture>/           a head's training folder (epoch-N/ checkpoints, a lock)
    <work_dir>/heads/<kind>-<mixture>/final/     the finished head, with its agreement-<key>.json caches
    <work_dir>/heads/<kind>-search-m<r>-n<size>/ a mixture-search trial's training folder (`taps search`)
    <work_dir>/heads/<kind>-searched/final/      the search's best head: the `searched` proposer
    <work_dir>/draft_vocab/<size>.safetensors    the reduced draft vocabulary
    <work_dir>/results/                          the evaluation's results store
    <work_dir>/tune/                             Ray Tune's storage (unless `ray.storage_path` is set), the
                                                 training and the search experiments
    <work_dir>/sweep.json                        the last sweep's summary
"""

from __future__ import annotations

from pathlib import Path

import yaml

from taps_ray.config import StudyConfig
from taps_ray.fsio import atomic_write_text

FINAL = "final"  # the finished checkpoint inside a head's training folder
EPOCH_GLOB = "epoch-*"  # the epoch checkpoints inside a head's training folder
SEARCHED = "searched"  # the head of the best mixture `taps search` found: drafts alone, never in a combination


def root(cfg: StudyConfig) -> Path:
    return cfg.work_path()


def data_summary(cfg: StudyConfig) -> Path:
    return cfg.work_path("data.json")


def features_root(cfg: StudyConfig) -> Path:
    return cfg.work_path("features")


def features_dir(cfg: StudyConfig, key: str) -> Path:
    """`key`: the feature set's name and settings digest (`training.features.features_key`)."""
    return features_root(cfg) / key


def in_workdir(cfg: StudyConfig, path: str | Path) -> str:
    """`path` relative to the work dir, as reports print it (no machine paths); other paths unchanged."""
    path = Path(path)
    try:
        return str(path.resolve().relative_to(cfg.work_path().resolve()))
    except ValueError:
        return str(path)


def heads_root(cfg: StudyConfig) -> Path:
    return cfg.work_path("heads")


def head_dir(cfg: StudyConfig, kind: str, mixture: str) -> Path:
    """The training folder of one head: its epoch checkpoints and, once finished, `final/`."""
    return heads_root(cfg) / f"{kind}-{mixture}"


def head_checkpoint(cfg: StudyConfig, kind: str, mixture: str) -> Path:
    """The finished head that evaluation, serving and benchmarks load."""
    return head_dir(cfg, kind, mixture) / FINAL


def search_trial_mixture(ratio: float, size: int) -> str:
    """The mixture name (and so the head folder) of a search trial: `ratio` of mathinstruct, `size` conversations."""
    return f"search-m{ratio:g}-n{size}"


def searched_head(cfg: StudyConfig, kind: str) -> Path:
    """The best head `taps search` found, loaded by the study as the `searched` proposer when it exists."""
    return head_checkpoint(cfg, kind, SEARCHED)


def epoch_checkpoint(head_folder: Path, epoch: int) -> Path:
    """The checkpoint a head's trainer leaves after `epoch` (weights, optimizer state of the newest, state.json)."""
    return head_folder / f"epoch-{epoch}"


def agreement_cache(checkpoint: Path, key: str) -> Path:
    """A head's held-out agreement, remembered next to its weights under a key of what it was measured on."""
    return checkpoint / f"agreement-{key}.json"


def draft_vocab_file(cfg: StudyConfig, size: int) -> Path:
    return cfg.work_path("draft_vocab", f"{size}.safetensors")


def results_dir(cfg: StudyConfig) -> Path:
    return cfg.work_path("results")


def tune_dir(cfg: StudyConfig) -> Path:
    return cfg.work_path("tune")


def sweep_summary(cfg: StudyConfig) -> Path:
    return cfg.work_path("sweep.json")


def study_config(cfg: StudyConfig) -> Path:
    """The config a sweep ran, saved beside its heads: `taps generate|serve|bench --config <this>` use them as
    they are (the `--quick` study's shrunken config exists nowhere else)."""
    return cfg.work_path("config.yaml")


def save_config(cfg: StudyConfig, path: Path) -> Path:
    """`cfg` as the YAML `load_config` reads back to the same config, written atomically to `path`; left as it is
    when it already says the same (a report-only or resumed stage writes nothing)."""
    text = yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)
    if not path.is_file() or path.read_text() != text:
        atomic_write_text(path, text)
    return path
