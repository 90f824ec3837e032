"""Data layer: source resolution and counts, normalisation, chat-template loss masks, mixtures, `taps data`."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from taps_ray.config import DATA_DIR_ENV, MixtureConfig, load_config, with_overrides
from taps_ray.data import sources
from taps_ray.data.chat import build_prompt_ids, end_of_turn_ids, tokenize_conversation
from taps_ray.data.commands import cmd_list, cmd_show
from taps_ray.data.mixtures import MixtureError, build_mixture, mixture_counts
from taps_ray.data.sources import DataUnavailable, list_datasets, load_conversations, load_questions, resolve

REPO = Path(__file__).resolve().parents[1]
DEFAULT_DATA = REPO.parent / "shared" / "data"


@pytest.fixture(autouse=True)
def _offline_with_shared_data(monkeypatch: pytest.MonkeyPatch) -> Path:
    data = Path(os.environ.get("TAPS_DATA_DIR") or DEFAULT_DATA)
    if not (data / "svamp" / "question.jsonl").is_file():
        pytest.skip(f"shared data folder {data} not found (set TAPS_DATA_DIR)")
    monkeypatch.setenv("TAPS_DATA_DIR", str(data))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return data


@pytest.fixture
def empty_dir(tmp_path: Path) -> Path:
    folder = tmp_path / "empty-data"
    folder.mkdir()
    return folder


@pytest.fixture(scope="module")
def tokenizer():
    from taps_ray.models.target import load_tokenizer

    return load_tokenizer()


# --- sources and counts ---------------------------------------------------------------------------------


def test_mt_bench_80_two_turn_questions():
    questions = load_questions("mt_bench")
    assert len(questions) == 80
    assert all(len(q.turns) == 2 for q in questions)
    assert [q.question_id for q in questions] == list(range(81, 161))
    assert len({q.category for q in questions}) == 8


def test_gsm8k_test_1319_with_final_answers():
    questions = load_questions("gsm8k")
    assert len(questions) == 1319
    assert questions[0].category == "gsm8k" and questions[0].reference == ["18"]
    assert all(len(q.turns) == 1 and q.reference and "####" not in q.reference[0] for q in questions)
    assert all("," not in q.reference[0] for q in questions)  # "1,600" -> "1600"


def test_math_500_local_then_partial_package(empty_dir: Path):
    local = resolve("math_500")
    assert local.kind == "local" and not local.partial
    assert len(load_questions("math_500")) == 500
    packaged = resolve("math_500", data_dir=empty_dir)
    assert packaged.kind == "package" and packaged.partial
    assert "311 of the 500" in packaged.source_label
    questions = load_questions("math_500", data_dir=empty_dir)
    assert len(questions) == 311
    assert questions[0].reference and questions[0].category == "math"


def test_svamp_local_only(empty_dir: Path):
    assert len(load_questions("svamp")) == 300
    with pytest.raises(DataUnavailable) as info:
        load_questions("svamp", data_dir=empty_dir)
    message = str(info.value)
    assert "svamp" in message and "TAPS_DATA_DIR" in message and "\n" not in message


def test_hub_never_tried_offline(empty_dir: Path, monkeypatch: pytest.MonkeyPatch):
    import datasets

    def boom(*args, **kwargs):  # pragma: no cover - must not run
        raise AssertionError("load_dataset called while HF_HUB_OFFLINE=1")

    monkeypatch.setattr(datasets, "load_dataset", boom)
    with pytest.raises(DataUnavailable, match="mathinstruct"):
        resolve("mathinstruct", data_dir=empty_dir)


def test_sharegpt_stream_parsed_and_normalised():
    source = resolve("sharegpt")
    assert source.kind in ("local", "package")
    convs = load_conversations("sharegpt")
    assert len(convs) > 17000
    for conv in convs[:2000]:
        roles = [m["role"] for m in conv.messages]
        assert len(roles) >= 2 and roles[0] == "user" and roles[-1] == "assistant"
        assert all(a != b for a, b in zip(roles, roles[1:]))
        assert all(m["content"].strip() for m in conv.messages)
    assert load_conversations("sharegpt", limit=5) == convs[:5]


def test_truncated_array_recovers_whole_records():
    text = '[\n {"id": "a", "conversations": []},\n {"id": "b", "x": [1, 2]},\n {"id": "c", "conv'
    assert [r["id"] for r in sources.parse_truncated_json_array(text)] == ["a", "b"]
    assert [r["id"] for r in sources.parse_truncated_json_array('[{"id": 1}, {"id": 2}]')] == [1, 2]


def test_sharegpt_normalisation_rules():
    record = {
        "id": "x",
        "conversations": [
            {"from": "gpt", "value": "leading assistant, trimmed"},
            {"from": "system", "value": "dropped"},
            {"from": "human", "value": "q1"},
            {"from": "bing", "value": "dropped"},
            {"from": "gpt", "value": "a1"},
            {"from": "human", "value": "q2"},
            {"from": "human", "value": "breaks alternation: cut here"},
            {"from": "gpt", "value": "a2"},
        ],
    }
    conv = sources.normalise_sharegpt(record)
    assert conv is not None and conv.id == "x"
    assert conv.messages == [{"role": "user", "content": "q1"}, {"role": "assistant", "content": "a1"}]
    assert sources.normalise_sharegpt({"id": "y", "conversations": [{"from": "human", "value": "q"}]}) is None


def test_mathinstruct_offline_is_an_honest_stand_in():
    source = resolve("mathinstruct")
    assert source.stand_in and source.kind == "local"
    assert "gsm8k_train stand-in for MathInstruct" in source.source_label
    convs = load_conversations("mathinstruct")
    assert len(convs) == 7473
    assert [m["role"] for m in convs[0].messages] == ["user", "assistant"]
    assert "####" in convs[0].messages[1]["content"]


def test_list_datasets_and_commands(empty_dir: Path, capsys: pytest.CaptureFixture):
    rows = {r.name: r for r in list_datasets()}
    assert set(rows) == {"mt_bench", "gsm8k", "math_500", "svamp", "sharegpt", "mathinstruct"}
    assert rows["svamp"].rows == 300 and rows["mathinstruct"].rows == 7473 and rows["mt_bench"].role == "eval"
    assert cmd_list(None) == 0
    out = capsys.readouterr().out
    assert "stand-in for MathInstruct" in out and "1319" in out
    assert cmd_show("gsm8k", 2, None) == 0
    assert "reference" in capsys.readouterr().out
    assert cmd_list(empty_dir) == 2
    assert "svamp" in capsys.readouterr().err
    assert cmd_show("svamp", 1, empty_dir) == 2
    assert cmd_show("no_such_set", 1, None) == 2


@pytest.mark.skipif(not (REPO / "taps_ray" / "cli.py").is_file(), reason="taps_ray/cli.py not written yet")
def test_cli_data_list_exit_code(empty_dir: Path):
    env = {**os.environ, "TAPS_DATA_DIR": str(empty_dir), "HF_HUB_OFFLINE": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "taps_ray.cli", "data", "list"], cwd=REPO, env=env, capture_output=True, text=True
    )
    assert result.returncode == 2, result.stderr
    assert "svamp" in result.stderr and "TAPS_DATA_DIR" in result.stderr


# --- chat templates -------------------------------------------------------------------------------------


def _spans(ids: list[int], mask: list[int]) -> list[list[int]]:
    spans, current = [], []
    for token, m in zip(ids, mask):
        if m:
            current.append(token)
        elif current:
            spans.append(current)
            current = []
    if current:
        spans.append(current)
    return spans


def test_loss_mask_covers_assistant_content_and_end_token(tokenizer):
    messages = [
        {"role": "user", "content": "What is 2 + 3?"},
        {"role": "assistant", "content": "2 + 3 = 5."},
        {"role": "user", "content": "And times 4?"},
        {"role": "assistant", "content": "5 * 4 = 20, so the answer is 20."},
    ]
    ids, mask = tokenize_conversation(tokenizer, messages, max_len=512)
    assert len(ids) == len(mask) and set(mask) <= {0, 1}
    (eot,) = end_of_turn_ids(tokenizer) & {tokenizer.convert_tokens_to_ids("<|im_end|>")}
    end = tokenizer.convert_ids_to_tokens(eot)
    decoded = [tokenizer.decode(span) for span in _spans(ids, mask)]
    assert decoded == [messages[1]["content"] + end, messages[3]["content"] + end]
    # the whole conversation is the template's rendering (with its default system prompt)
    assert tokenizer.decode(ids) == tokenizer.apply_chat_template(messages, tokenize=False)
    assert mask[-1] == 0


def test_loss_mask_truncation(tokenizer):
    conv = load_conversations("mathinstruct", limit=1)[0]
    ids, mask = tokenize_conversation(tokenizer, conv.messages, max_len=60)
    full_ids, full_mask = tokenize_conversation(tokenizer, conv.messages, max_len=4096)
    assert len(ids) == 60 and ids == full_ids[:60]
    assert mask[:-1] == full_mask[:59] and mask[-1] == 0 and full_mask[-1] == 0
    assert sum(full_mask) > 0


def test_multi_turn_prompt_contains_first_answer(tokenizer):
    question = load_questions("mt_bench", limit=1)[0]
    answer = "Aloha! Hawaii was wonderful."
    ids = build_prompt_ids(tokenizer, question.turns, [answer])
    text = tokenizer.decode(ids)
    assert question.turns[0] in text and answer in text and question.turns[1] in text
    assert text.index(question.turns[0]) < text.index(answer) < text.index(question.turns[1])
    assert text.endswith("<|im_start|>assistant\n")
    first = tokenizer.decode(build_prompt_ids(tokenizer, question.turns[:1], [], system_prompt="Be brief."))
    assert "Be brief." in first and answer not in first and "SmolLM" not in first


# --- mixtures -------------------------------------------------------------------------------------------


def test_mixture_deterministic_and_respects_ratio():
    config = MixtureConfig(mixture={"mathinstruct": 3, "sharegpt": 1}, size=40, seed=7)
    assert mixture_counts(config) == {"mathinstruct": 30, "sharegpt": 10}
    first = build_mixture(config)
    again = build_mixture(config)
    assert [c.id for c in first] == [c.id for c in again]
    assert len(first) == 40 and len({c.id for c in first}) == 40
    assert sum(c.source == "mathinstruct" for c in first) == 30
    assert sum(c.source == "sharegpt" for c in first) == 10
    other = build_mixture(config.model_copy(update={"seed": 8}))
    assert [c.id for c in other] != [c.id for c in first]
    # rounding keeps the total: 0.5/0.5 of an odd size
    assert sum(mixture_counts(MixtureConfig(mixture={"mathinstruct": 1, "sharegpt": 1}, size=5)).values()) == 5


def test_mixture_larger_than_corpus_is_a_clear_error():
    config = MixtureConfig(mixture={"mathinstruct": 1.0}, size=10_000, seed=0)
    with pytest.raises(MixtureError, match="mathinstruct.*7473"):
        build_mixture(config)


def test_data_dir_precedence_is_flag_then_env_then_yaml(monkeypatch, tmp_path):
    """Every command applies --data-dir through `with_overrides`: flag > TAPS_DATA_DIR > the config's data_dir."""
    cfg = load_config(REPO / "configs" / "tiny.yaml").model_copy(update={"data_dir": str(tmp_path / "yaml")})
    monkeypatch.delenv(DATA_DIR_ENV, raising=False)
    assert cfg.resolved_data_dir() == tmp_path / "yaml"
    monkeypatch.setenv(DATA_DIR_ENV, str(tmp_path / "env"))
    assert cfg.resolved_data_dir() == tmp_path / "env"
    assert with_overrides(cfg).resolved_data_dir() == tmp_path / "env"
    flagged = with_overrides(cfg, data_dir=str(tmp_path / "flag"), work_dir=str(tmp_path / "work"))
    assert flagged.resolved_data_dir() == tmp_path / "flag" == sources.local_data_dir()  # loaders see the flag too
    assert flagged.work_dir == str(tmp_path / "work") and flagged.reports_dir == cfg.reports_dir
