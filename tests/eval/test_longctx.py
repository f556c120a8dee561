"""The long-context evaluation (tools/eval/longctx.py) in small: every task writes one file
per item, a second run skips what is there, and a row added later is measured alone."""
import json
import os

import pytest

import numpy as np

from tools.eval.longctx import (EXACT_ROW, Store, cached_prefill, long_text, multikey_prompt,
                                row_configs, run_kl, run_multikey, run_passkey, slug, summarize)

LENGTH, POSITIONS = 320, 12


def snapshot(folder):
    return {os.path.join(root, name): os.path.getmtime(os.path.join(root, name))
            for root, _, names in os.walk(folder) for name in names}


@pytest.fixture(scope="module")
def measured(model, tmp_path_factory):
    base = tmp_path_factory.mktemp("longctx")
    store, work = Store(str(base / "out")), str(base / "work")
    configs = row_configs(["llama.cpp q4_0", "q3 preset"], ["Q2d K mix2.5, V ternary"], LENGTH + 64)
    counts = (run_kl(model, "smollm2-135m", LENGTH, POSITIONS, configs, store, work, False),
              run_passkey(model, "smollm2-135m", LENGTH, 2, configs, store, work, False),
              run_multikey(model, "smollm2-135m", LENGTH, 1, 2, configs, store, work, False))
    return store, work, configs, counts


def test_every_task_writes_one_item_per_row_or_prompt(measured):
    store, _, configs, counts = measured
    assert counts == (3, 2, 2)
    reference = store.get("kl", "reference")
    assert reference["prefix"] == LENGTH - POSITIONS and reference["perplexity"] > 1
    for config in configs:
        item = store.get("kl", slug(config.name))
        assert item is not None, config.name
        assert len(item["kl_per_position"]) == POSITIONS
        assert item["mean_kl"] >= 0 and 0 <= item["top1"] <= 1
    assert store.get("kl", "llama-cpp-q4-0")["bits_at_8k"] == 4.5
    for item in store.items("passkey") + store.items("multikey"):
        assert set(item["answers"]) == {EXACT_ROW} | {c.name for c in configs}
        assert item["prompt_tokens"] <= LENGTH
    # SmolLM2 finds a pass key in a 128-token haystack with the exact cache
    assert any(i["correct"][EXACT_ROW] for i in store.items("passkey"))


def test_a_second_run_skips_finished_items_and_a_new_row_runs_alone(model, measured):
    store, work, configs, _ = measured
    before = snapshot(store.out)
    again = (run_kl(model, "smollm2-135m", LENGTH, POSITIONS, configs, store, work, False),
             run_passkey(model, "smollm2-135m", LENGTH, 2, configs, store, work, False),
             run_multikey(model, "smollm2-135m", LENGTH, 1, 2, configs, store, work, False))
    assert again == (0, 0, 0) and snapshot(store.out) == before
    earlier = {i["depth"]: dict(i["answers"]) for i in store.items("passkey")}
    added = configs + row_configs(["llama.cpp q8_0"], [], LENGTH + 64)
    assert run_passkey(model, "smollm2-135m", LENGTH, 2, added, store, work, False) == 2
    for item in store.items("passkey"):
        assert "llama.cpp q8_0" in item["answers"]
        assert {k: v for k, v in item["answers"].items() if k != "llama.cpp q8_0"} == earlier[item["depth"]]
    text = summarize(store, {"model": "SmolLM2", "length": LENGTH})
    assert "| llama.cpp q8_0 | — | — |" in text and "Q2d K mix2.5, V ternary" in text
    with open(os.path.join(store.out, "summary.json")) as f:
        assert json.load(f)["passkey"][EXACT_ROW].endswith("/2")


def test_a_kept_prefill_loads_as_computed_and_once(model, measured):
    """A resumed run reads the work folder's K/V: the same numbers as the prefill, every layer
    a view of one loaded array (a 16k-token Qwen prefill read once per layer would need 26 GB)."""
    _, work, _, _ = measured
    prefix = LENGTH - POSITIONS
    tokens = model.tokenizer.encode(long_text())[:prefix]
    kept = cached_prefill(os.path.join(work, f"smollm2-135m-kl-{prefix}.npz"), model, tokens, False)
    computed = model.forward(tokens, all_logits=False)[1]
    assert len(kept) == len(computed) == model.shape.num_layers
    for (k, v), (k_ref, v_ref) in zip(kept, computed):
        np.testing.assert_allclose(k, k_ref, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(v, v_ref, rtol=1e-5, atol=1e-5)
    assert len({id(k.base) for k, _ in kept}) == 1 and len({id(v.base) for _, v in kept}) == 1


def test_multikey_haystack_holds_every_key_once(model):
    prompt, questions = multikey_prompt(model, 600, 3, trial=0)
    text = model.tokenizer.decode(prompt)
    assert len({door for door, *_ in questions}) == 3
    for door, key, depth, question in questions:
        assert text.count(f"The pass key of the {door} door is {key}.") == 1
        assert model.tokenizer.decode(question).endswith(f"The pass key of the {door} door is")
        assert 0 < depth < 1
    depths = [q[2] for q in questions]
    assert depths == sorted(depths)


def test_long_text_is_long_enough_for_16k_tokens(model):
    assert len(model.tokenizer.encode(long_text())) > 16384 + 1
