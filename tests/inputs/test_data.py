"""Prompt loading from real JSONL/Parquet files, the built-in task, batching order and the warm-up data."""

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from cloudrl.trainer.config import DataConfig
from cloudrl.trainer.errors import DataError
from cloudrl.trainer.inputs.data import PromptLoader, PromptRecord, load_prompts
from cloudrl.trainer.inputs.demo import arithmetic_pairs, build_char_tokenizer, format_warmup_batches
from cloudrl.trainer.inputs.rewards import gsm8k, score

REPO = Path(__file__).resolve().parents[2]
SAMPLE = REPO / "examples" / "data" / "gsm8k_sample.jsonl"
TEMPLATE = (
    "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}[assistant]{% endif %}"
)

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}]
ROWS = [
    {"prompt": "1+1=", "reward_model": {"style": "rule", "ground_truth": "2"}, "data_source": "toy", "level": 1},
    {"prompt": CHAT, "reward_model": {"style": "rule", "ground_truth": "4"}, "data_source": "toy", "level": 2},
]


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


@pytest.fixture(scope="module")
def chat_tok():
    t = build_char_tokenizer()
    t.chat_template = TEMPLATE
    return t


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def write_parquet(path, rows):
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


@pytest.fixture(params=["jsonl", "parquet"])
def data_file(request, tmp_path):
    """Both rows as `files`: one JSONL file, or two Parquet files (a column has one type there)."""
    ext = request.param
    if ext == "jsonl":
        return str(write_jsonl(tmp_path / "toy.jsonl", ROWS))
    strings = write_parquet(tmp_path / "strings.parquet", ROWS[:1])
    chats = write_parquet(tmp_path / "chats.parquet", ROWS[1:])
    return f"{strings},{chats}"


def write_text(path, text):
    path.write_text(text)
    return path


def write_empty_parquet(path):
    pq.write_table(pa.table({"prompt": pa.array([], pa.string())}), path)
    return path


def decode(tok, ids):
    return tok.decode(ids, skip_special_tokens=False)


# ----------------------------------------------------------------------------------------------
# Files
# ----------------------------------------------------------------------------------------------


def test_string_and_chat_prompts_without_template(data_file, tok):
    first, second = load_prompts(data_file, tok)
    assert first.prompt_text == "1+1="
    assert second.prompt_text == "system: Be brief.\nuser: What is 2+2?"
    for rec in (first, second):
        assert decode(tok, rec.prompt_ids) == rec.prompt_text
    assert [first.ground_truth, second.ground_truth] == ["2", "4"]
    assert first.data_source == "toy"
    # Other columns travel along; the prompt and the reserved names do not.
    assert first.extra == {"reward_model": {"style": "rule", "ground_truth": "2"}, "level": 1}
    json.dumps(second.extra)


def test_chat_template_applied(data_file, chat_tok):
    first, second = load_prompts(data_file, chat_tok)
    assert first.prompt_text == "[user]1+1=\n[assistant]"
    assert second.prompt_text == "[system]Be brief.\n[user]What is 2+2?\n[assistant]"
    assert decode(chat_tok, second.prompt_ids) == second.prompt_text


def test_builtin_task_ignores_chat_template(chat_tok):
    records = load_prompts("builtin:arithmetic", chat_tok, split="val")
    assert records[0].prompt_text == "0+0="
    assert decode(chat_tok, records[0].prompt_ids) == "0+0="


def test_left_truncation_keeps_the_end(tmp_path, tok):
    path = write_jsonl(tmp_path / "long.jsonl", [{"prompt": "abcdefghij" * 3 + "Q: 3+4="}])
    (rec,) = load_prompts(str(path), tok, max_prompt_length=8)
    assert len(rec.prompt_ids) == 8
    assert rec.prompt_text == "jQ: 3+4="
    assert decode(tok, rec.prompt_ids) == rec.prompt_text
    # max_prompt_length falls back to data_cfg's value.
    (rec,) = load_prompts(str(path), tok, data_cfg=DataConfig(max_prompt_length=5))
    assert rec.prompt_text == " 3+4="


def test_ground_truth_columns_and_default_source(tmp_path, tok):
    rows = [{"prompt": "a", "ground_truth": 12}, {"prompt": "b", "answer": "x #### 7"}, {"prompt": "c"}]
    path = write_jsonl(tmp_path / "flat.jsonl", rows)
    records = load_prompts(str(path), tok)
    assert [r.ground_truth for r in records] == ["12", "x #### 7", ""]
    assert {r.data_source for r in records} == {"flat"}  # no data_source column: the file's stem
    assert records[1].extra == {"answer": "x #### 7"}


def test_custom_prompt_key_and_several_files(tmp_path, tok):
    a = write_jsonl(tmp_path / "a.jsonl", [{"question": "q1"}])
    b = write_parquet(tmp_path / "b.parquet", [{"question": "q2"}, {"question": "q3"}])
    records = load_prompts(f"{a}, {b}", tok, prompt_key="question")
    assert [r.prompt_text for r in records] == ["q1", "q2", "q3"]
    assert [r.data_source for r in records] == ["a", "b", "b"]
    records = load_prompts(
        f"{a},builtin:arithmetic", tok, data_cfg=DataConfig(prompt_key="question", arithmetic_size=3)
    )
    assert len(records) == 4


def test_answer_key_and_prompt_template(tmp_path, tok):
    rows = [{"question": "2+2?", "solution": "4", "answer": "not this"}, {"question": CHAT, "solution": 7}]
    path = write_jsonl(tmp_path / "raw.jsonl", rows)
    cfg = DataConfig(prompt_key="question", answer_key="solution", prompt_template="{prompt} Answer after ####.")
    first, second = load_prompts(str(path), tok, data_cfg=cfg, max_prompt_length=256)
    assert first.prompt_text == "2+2? Answer after ####."
    assert second.prompt_text == "system: Be brief.\nuser: What is 2+2? Answer after ####."  # the last user message
    assert [first.ground_truth, second.ground_truth] == ["4", "7"]
    assert first.extra == {"solution": "4", "answer": "not this"}
    with pytest.raises(
        DataError,
        match=r"raw\.jsonl: no 'truth' column \(it has question, solution, answer\): "
        r"set data\.answer_key=<one of them>",
    ):
        load_prompts(str(path), tok, data_cfg=DataConfig(prompt_key="question", answer_key="truth"))


@pytest.mark.parametrize(
    "make, split, message",
    [
        (lambda d: str(d / "nope.jsonl"), "train", "data file not found: {d}/nope.jsonl (relative to"),
        (lambda d: str(d / "nope.jsonl"), "val", "check data.val_files"),
        (lambda d: str(d / "rows.csv"), "train", "rows.csv: unsupported file type '.csv': use .jsonl or .parquet"),
        (
            lambda d: write_jsonl(d / "q.jsonl", [{"question": "hi", "answer": "1"}]),
            "train",
            "q.jsonl: no 'prompt' column (it has question, answer): set data.prompt_key=<one of them>",
        ),
        (
            lambda d: write_jsonl(d / "empty.jsonl", []),
            "train",
            "empty.jsonl: the file has no rows: add prompts or remove it from data.train_files",
        ),
        (lambda d: write_empty_parquet(d / "empty.parquet"), "train", "empty.parquet: the file has no rows"),
        (
            lambda d: write_text(d / "bad.jsonl", '{"prompt": "ok"}\n\n{"prompt": oops}\n'),
            "train",
            "bad.jsonl:3: not valid JSON (Expecting value): fix or remove the line",
        ),
        (lambda d: write_text(d / "list.jsonl", '["prompt"]\n'), "train", "list.jsonl:1: a line must be a JSON object"),
        (
            lambda d: write_jsonl(d / "n.jsonl", [{"prompt": "a"}, {"prompt": None}]),
            "train",
            "n.jsonl:2: 'prompt' must be a string or a list of",
        ),
        (
            lambda d: write_jsonl(d / "m.jsonl", [{"prompt": [{"role": "user"}]}]),
            "train",
            "m.jsonl:1: 'prompt' must be a string or a list of",
        ),
        (lambda d: write_jsonl(d / "e.jsonl", [{"prompt": ""}]), "train", "e.jsonl:1: the prompt is empty"),
        (lambda d: write_text(d / "junk.parquet", "not parquet"), "train", "junk.parquet: not a readable Parquet file"),
        (lambda d: "builtin:algebra", "train", "unknown built-in dataset 'builtin:algebra' in data.train_files"),
        (lambda d: " , ", "train", "no prompt files given: set data.train_files="),
    ],
)
def test_bad_inputs(tmp_path, tok, make, split, message):
    files = make(tmp_path)
    with pytest.raises(DataError) as err:
        load_prompts(str(files), tok, split=split)
    assert message.format(d=tmp_path) in str(err.value)
    assert "\n" not in str(err.value)


def test_parquet_row_numbers_in_errors(tmp_path, tok):
    path = write_parquet(tmp_path / "p.parquet", [{"prompt": "a"}, {"prompt": None}])
    with pytest.raises(DataError, match=r"p\.parquet:row 1: 'prompt' must be a string"):
        load_prompts(str(path), tok)


def test_shipped_gsm8k_sample_loads_and_scores(tok, chat_tok):
    records = load_prompts(str(SAMPLE), tok, max_prompt_length=1024)
    assert len(records) >= 15
    assert all(r.data_source == "openai/gsm8k" and r.ground_truth for r in records)
    assert all(r.prompt_text.startswith("user: ") and "####" in r.prompt_text for r in records)
    solutions = [r.extra["extra_info"]["answer"] for r in records]
    assert score(gsm8k, solutions, records) == [1.0] * len(records)
    # The same solutions are wrong for the next problem's answer.
    shifted = solutions[1:] + solutions[:1]
    assert sum(score(gsm8k, shifted, records)) == 0.0
    templated = load_prompts(str(SAMPLE), chat_tok, max_prompt_length=1024)
    assert templated[0].prompt_text.startswith("[user]") and templated[0].prompt_text.endswith("[assistant]")


# ----------------------------------------------------------------------------------------------
# The built-in task
# ----------------------------------------------------------------------------------------------


def test_arithmetic_train_is_seeded(tok):
    cfg = DataConfig(arithmetic_max_operand=3, arithmetic_size=50)
    a = load_prompts("builtin:arithmetic", tok, data_cfg=cfg, seed=7)
    b = load_prompts("builtin:arithmetic", tok, data_cfg=cfg, seed=7)
    c = load_prompts("builtin:arithmetic", tok, data_cfg=cfg, seed=8)
    assert len(a) == 50
    assert [r.prompt_text for r in a] == [r.prompt_text for r in b]
    assert [r.prompt_text for r in a] != [r.prompt_text for r in c]
    for r in a:
        x, y = map(int, r.prompt_text[:-1].split("+"))
        assert 0 <= x <= 3 and 0 <= y <= 3
        assert r.ground_truth == str(x + y) and r.data_source == "arithmetic"
        assert decode(tok, r.prompt_ids) == r.prompt_text


def test_arithmetic_val_is_every_pair_once(tok):
    cfg = DataConfig(arithmetic_max_operand=4, arithmetic_size=3)
    val = load_prompts("builtin:arithmetic", tok, split="val", data_cfg=cfg, seed=1)
    again = load_prompts("builtin:arithmetic", tok, split="val", data_cfg=cfg, seed=99)
    texts = [r.prompt_text for r in val]
    assert texts == [r.prompt_text for r in again]
    assert len(texts) == len(set(texts)) == 25
    assert set(texts) == {f"{a}+{b}=" for a in range(5) for b in range(5)}
    assert arithmetic_pairs(1) == [(0, 0), (0, 1), (1, 0), (1, 1)]


# ----------------------------------------------------------------------------------------------
# PromptLoader
# ----------------------------------------------------------------------------------------------


def make_records(n):
    return [PromptRecord([i + 3], f"p{i}", str(i), "toy", {}) for i in range(n)]


def texts(batch):
    return [r.prompt_text for r in batch]


@pytest.mark.parametrize("shuffle", [True, False])
@pytest.mark.parametrize("consumed", [0, 1, 3, 4, 9])
def test_loader_resume_gives_the_same_batches(shuffle, consumed):
    records = make_records(10)
    straight = PromptLoader(records, batch_size=4, shuffle=shuffle, seed=3)
    for _ in range(consumed):
        straight.next_batch()
    state = json.loads(json.dumps(straight.state_dict()))  # as a checkpoint would store it
    resumed = PromptLoader(records, batch_size=4, shuffle=shuffle, seed=3)
    resumed.load_state_dict(state)
    for _ in range(8):
        assert texts(resumed.next_batch()) == texts(straight.next_batch())


def test_loader_epochs_cover_every_record_and_differ():
    loader = PromptLoader(make_records(6), batch_size=4, shuffle=True, seed=0)
    assert len(loader) == 6
    seen = [t for _ in range(3) for t in texts(loader.next_batch())]  # 12 = two epochs exactly
    epoch0, epoch1 = seen[:6], seen[6:]
    assert sorted(epoch0) == sorted(epoch1) == sorted(f"p{i}" for i in range(6))
    assert epoch0 != epoch1
    assert loader.state_dict() == {"epoch": 1, "index": 6}
    # The second batch spans the epoch boundary: 2 from epoch 0, 2 from epoch 1.
    other = PromptLoader(make_records(6), batch_size=4, shuffle=True, seed=1)
    assert [t for _ in range(3) for t in texts(other.next_batch())] != seen


def test_loader_without_shuffle_keeps_file_order():
    loader = PromptLoader(make_records(3), batch_size=2, shuffle=False, seed=0)
    assert [texts(loader.next_batch()) for _ in range(3)] == [["p0", "p1"], ["p2", "p0"], ["p1", "p2"]]


def test_loader_bad_state_and_empty_records():
    loader = PromptLoader(make_records(3), batch_size=2, shuffle=True)
    with pytest.raises(DataError, match="does not fit a dataset of 3 prompts"):
        loader.load_state_dict({"epoch": 0, "index": 7})
    with pytest.raises(DataError, match="no prompts to batch"):
        PromptLoader([], batch_size=2, shuffle=True)


# ----------------------------------------------------------------------------------------------
# Format warm-up batches
# ----------------------------------------------------------------------------------------------


def test_format_warmup_batches(tok):
    batches = format_warmup_batches(tok, max_operand=2, seed=5, batch_size=32)
    answers_by_prompt: dict[str, set[int]] = {}
    for _ in range(6):
        input_ids, attention_mask, labels = next(batches)
        assert input_ids.shape == attention_mask.shape == labels.shape and input_ids.shape[0] == 32
        assert input_ids.dtype == attention_mask.dtype == labels.dtype == torch.long
        for ids, mask, lab in zip(input_ids.tolist(), attention_mask.tolist(), labels.tolist()):
            n = sum(mask)
            assert mask == [1] * n + [0] * (len(mask) - n)  # right-padded
            assert ids[n:] == [tok.pad_token_id] * (len(ids) - n) and all(x == -100 for x in lab[n:])
            text = decode(tok, ids[:n])
            prompt, _, rest = text.partition("=")
            prompt += "="
            assert all(x == -100 for x in lab[: len(prompt)])  # prompt tokens are not learned
            assert lab[len(prompt) : n] == ids[len(prompt) : n]  # answer and EOS are
            assert ids[n - 1] == tok.eos_token_id
            answer = int(rest[: -len(tok.eos_token)])
            assert 0 <= answer <= 4
            answers_by_prompt.setdefault(prompt, set()).add(answer)
    # Answers are random, not the sum: prompts get several different answers.
    assert all(len(v) >= 3 for v in answers_by_prompt.values())
    wrong = sum(1 for p, v in answers_by_prompt.items() for a in v if a != sum(map(int, p[:-1].split("+"))))
    assert wrong > 0
    again = format_warmup_batches(tok, max_operand=2, seed=5, batch_size=32)
    first = format_warmup_batches(tok, max_operand=2, seed=5, batch_size=32)
    assert all(torch.equal(a, b) for a, b in zip(next(again), next(first)))


def test_peek_batches_are_the_next_batches_without_taking_them():
    """Across epoch boundaries (6 records, batches of 4): peeking twice gives the same batches, the loader's
    position only moves on a take, and the k-th peeked batch is the k-th taken (rollout.max_staleness=k starts
    batches k steps ahead)."""
    loader = PromptLoader(make_records(6), batch_size=4, shuffle=True, seed=0)
    for taken in range(5):
        state = loader.state_dict()
        peeked = [texts(b) for b in loader.peek_batches(3)]
        assert [texts(b) for b in loader.peek_batches(3)] == peeked
        assert loader.state_dict() == state
        reference = PromptLoader(make_records(6), batch_size=4, shuffle=True, seed=0)
        for _ in range(taken):
            reference.next_batch()
        assert [texts(reference.next_batch()) for _ in range(3)] == peeked
        assert texts(loader.next_batch()) == peeked[0]
