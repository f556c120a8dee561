"""Pass-key retrieval (tools/eval/passkey.py) on SmolLM2, short haystacks."""

from tools.eval.evaluate import CacheConfig
from tools.eval.passkey import answer_key, make_prompts, markdown, needle, resumed, run_prompt, spread_order


def test_prompts_put_the_needle_at_the_requested_depths(model):
    depths = [0.05, 0.5, 0.95]
    head, prompts = make_prompts(model, 1024, depths)
    header = len(head) - 1024
    tok = model.tokenizer
    for depth, prompt in zip(depths, prompts):
        needle_ids = tok.encode(needle(prompt.key))
        assert prompt.rest[:len(needle_ids)] == needle_ids
        # the haystack before the needle is the shared head's
        assert abs((prompt.prefix_tokens - header) / 1024 - depth) < 0.08
        assert prompt.prefix_tokens + len(prompt.rest) == len(head) + len(needle_ids)
        assert 10000 <= prompt.key < 100000
        assert tok.decode(prompt.question).endswith("<|im_start|>assistant\nThe pass key is")
    assert len({p.key for p in prompts}) == len(prompts)


def test_answer_key_reads_the_first_number():
    assert answer_key(" 40833.<|im_end|>") == 40833
    assert answer_key(" 4083 3") == 4083
    assert answer_key(" none") is None


def test_exact_and_compressed_caches_answer(model):
    head, prompts = make_prompts(model, 384, [0.5])
    _, head_kv = model.forward(head, all_logits=False)
    configs = [CacheConfig("exact preset", "exact", {"dtype": "float16"}),
               CacheConfig("q4_0", "q4_0", anchor=True)]
    answers, caches = run_prompt(model, head_kv, prompts[0], configs)
    key = prompts[0].key
    assert answer_key(answers[0]) == key  # SmolLM2 finds it with the exact cache
    assert answer_key(answers[1]) == key  # fp16 storage changes nothing here
    length = prompts[0].prefix_tokens + len(prompts[0].rest) + len(prompts[0].question) + 5
    assert caches[0].lengths == [length] * model.shape.num_layers
    assert caches[1].cache.stats()["bytes_fp16_equivalent"] == \
        length * model.shape.num_layers * model.shape.num_kv_heads * model.shape.head_dim * 2 * 2


def test_table_counts_exact_matches():
    result = {"meta": {"lengths": [10, 20], "bits_length": 8192},
              "rows": [{"name": "a", "bits_at_length": 32.0}, {"name": "b", "bits_at_length": 4.5}],
              "records": [{"length": 10, "correct": {"a": True, "b": False}},
                          {"length": 20, "correct": {"a": True, "b": True}},
                          {"length": 20, "correct": {"a": False, "b": True}}]}
    table = markdown(result)
    assert "| a | 32.00 | 1/1 | 1/2 | 2/3 |" in table
    assert "| b | 4.50 | 0/1 | 2/2 | 2/3 |" in table


def test_spread_order_visits_every_depth_once_ends_first():
    for n in range(1, 12):
        order = spread_order(list(range(n)))
        assert sorted(order) == list(range(n))
        assert order[:2] == [0, n - 1][:n]


def test_a_stopped_run_resumes_only_with_the_same_model_depths_and_rows(tmp_path):
    import json

    depths, names = [0.05, 0.95], ["exact (numpy fp32)", "q3 preset"]
    records = [{"length": 2048, "depth": 0.05, "key": 12345, "correct": {}},
               {"length": 4096, "depth": 0.05, "key": 54321, "correct": {}}]
    earlier = {"meta": {"model": "M", "lengths": [2048, 4096], "depths": depths, "seconds": 100.0},
               "rows": [{"name": names[0], "bits_at_length": 32.0},
                        {"name": names[1], "bits_at_length": 2.96}],
               "records": records}
    (tmp_path / "passkey.json").write_text(json.dumps(earlier))
    assert resumed(str(tmp_path), "M", depths, names, [2048, 4096]) == (records, {"q3 preset": 2.96}, 100.0)
    assert resumed(str(tmp_path), "M", depths, names, [4096])[0] == records[1:]   # other lengths dropped
    nothing = ([], {}, 0.0)
    assert resumed(str(tmp_path), "other model", depths, names, [2048]) == nothing
    assert resumed(str(tmp_path), "M", [0.05, 0.5, 0.95], names, [2048]) == nothing
    assert resumed(str(tmp_path), "M", depths, names[:1], [2048]) == nothing
    added = resumed(str(tmp_path), "M", depths, names + ["q3 B64 R16 S16"], [2048])   # a row added
    assert added == (records[:1], {"q3 preset": 2.96}, 100.0)
    assert resumed(str(tmp_path), "M", depths, ["q3 B64 R16 S16"] + names, [2048]) == nothing
    assert resumed(str(tmp_path / "none"), "M", depths, names, [2048]) == nothing
    assert resumed(str(tmp_path), "M", depths, names, [2048], answer_tokens=12) == nothing  # longer answers
    assert resumed(None, "M", depths, names, [2048]) == nothing


def test_a_row_added_on_resuming_shows_no_count_for_the_earlier_prompts():
    result = {"meta": {"lengths": [2048, 4096], "bits_length": 8192},
              "rows": [{"name": "a", "bits_at_length": 32.0}, {"name": "b", "bits_at_length": 2.9}],
              "records": [{"length": 2048, "correct": {"a": True}},
                          {"length": 4096, "correct": {"a": True, "b": False}}]}
    lines = markdown(result).splitlines()
    assert lines[2] == "| a | 32.00 | 1/1 | 1/1 | 2/2 |"
    assert lines[3] == "| b | 2.90 | — | 0/1 | 0/1 |"
