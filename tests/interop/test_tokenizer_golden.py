"""Against `transformers` itself (the `golden` extra: transformers + torch; skipped without it):
a random DeepSeek-V3 built by transformers with a BPE tokenizer, imported here, encodes and
greedy-generates like transformers; a model trained here, exported, loads in transformers and
greedy-generates what this project's engine does."""

from __future__ import annotations

import dataclasses
import math

import jax
import numpy as np
import pytest

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

from composer_jax import interop  # noqa: E402
from composer_jax.data import load_tokenizer  # noqa: E402
from composer_jax.data.chat import chat_format_for  # noqa: E402
from composer_jax.infer import InferenceEngine, SamplingParams  # noqa: E402
from composer_jax.train import load_run, run_pretraining  # noqa: E402
from tests.data.helpers import TRICKY_TEXTS, make_hf_folder  # noqa: E402
from tests.train.helpers import ONE_PHASE, make_corpus, tiny_experiment  # noqa: E402

VOCAB = 416
NEW_TOKENS = 24
PROMPTS = ("def add(a, b):", "class Foo:\n    def", "héllo wörld, 中文", "<think>")
# A step's top-2 logits closer than this are a tie: the two implementations may break it
# differently, so tokens are compared up to the first tie only.
TIE = 1e-3

HF_CONFIG = {
    "vocab_size": VOCAB,
    "hidden_size": 32,
    "intermediate_size": 64,
    "moe_intermediate_size": 12,
    "num_hidden_layers": 3,
    "first_k_dense_replace": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "q_lora_rank": 24,
    "kv_lora_rank": 16,
    "qk_nope_head_dim": 8,
    "qk_rope_head_dim": 4,
    "v_head_dim": 6,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "n_group": 2,
    "topk_group": 1,
    "n_shared_experts": 1,
    "routed_scaling_factor": 2.5,
    "norm_topk_prob": True,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "max_position_embeddings": 128,
    "tie_word_embeddings": False,
    "attention_bias": False,
}


def _load_hf(folder):
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        folder,
        dtype=torch.float32,
        attn_implementation="eager",
        experts_implementation="eager",
        output_loading_info=True,
    )
    assert not any(info.values()), f"{folder}: loading problems {info}"
    return model.eval()


def _randomise(model, seed):
    """Weights that keep activations O(1) and route decisively (see make_hf_golden.py)."""
    rng = np.random.default_rng(seed)
    state = {}
    for name, value in model.state_dict().items():
        shape = tuple(value.shape)
        if name.endswith("norm.weight"):
            new = 1.0 + 0.25 * rng.standard_normal(shape)
        elif name.endswith("e_score_correction_bias"):
            new = 0.3 * rng.standard_normal(shape)
        elif name.endswith("mlp.gate.weight"):
            new = 3.0 / math.sqrt(shape[-1]) * rng.standard_normal(shape)
        elif name == "model.embed_tokens.weight":
            new = rng.standard_normal(shape)
        elif len(shape) >= 2:
            new = rng.standard_normal(shape) / math.sqrt(shape[-1])
        else:
            new = value.numpy()
        state[name] = torch.from_numpy(np.asarray(new, np.float32))
    model.load_state_dict(state)


def _hf_greedy(model, prompt, stops):
    out = model.generate(
        torch.tensor([prompt]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        max_new_tokens=NEW_TOKENS,
        do_sample=False,
        eos_token_id=stops,
        pad_token_id=stops[0],
        output_logits=True,
        return_dict_in_generate=True,
    )
    tokens = out.sequences[0, len(prompt) :].tolist()
    gaps = []
    for logits in out.logits:
        top2 = torch.topk(logits[0].float(), 2).values
        gaps.append(float(top2[0] - top2[1]))
    return tokens, gaps


def _ours_greedy(model, stops, prompts):
    engine = InferenceEngine(model, num_slots=4, max_len=256, prefill_buckets=(16, 128, 256))
    params = SamplingParams(
        temperature=0.0, max_new_tokens=NEW_TOKENS, stop_sequences=tuple((i,) for i in stops)
    )
    return [c.tokens for c in engine.generate(prompts, params)]


def _compare_greedy(hf_model, ours_model, tokenizer, prompts=None, stops=None):
    """Greedy continuations of `prompts` (ids; PROMPTS with bos by default) agree token for
    token up to each one's first near-tie, stopping at `stops` (eos by default)."""
    prompts = prompts or [tokenizer.encode(p, add_bos=True) for p in PROMPTS]
    stops = list(stops or [tokenizer.eos_id])
    ours = _ours_greedy(ours_model, stops, prompts)
    compared = 0
    for prompt, got in zip(prompts, ours):
        want, gaps = _hf_greedy(hf_model, prompt, stops)
        untied = next((i for i, g in enumerate(gaps) if g < TIE), len(want))
        assert got[: untied + 1] == want[: untied + 1], (prompt, got, want, untied)
        compared += untied + 1
    assert compared >= len(prompts) * NEW_TOKENS // 2, f"only {compared} tokens were untied"


def _renders_like_transformers(chat, hf_tokenizer, messages, task: str, head: int) -> list[int]:
    """The chat template renders `messages` (with and without the generation prompt) as
    transformers does, and the prompt of `task` is transformers' ids for the first `head`
    messages; returns those ids."""
    for generation_prompt in (False, True):
        assert chat.render(messages, generation_prompt) == hf_tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=generation_prompt
        )
    prompt = chat.prompt(task)
    assert prompt == hf_tokenizer.apply_chat_template(
        messages[:head], tokenize=True, add_generation_prompt=True, return_dict=False
    )
    return prompt


def test_transformers_model_and_tokenizer_imported_here(tmp_path):
    make_hf_folder(tmp_path, vocab_size=400)
    config = transformers.DeepseekV3Config(**HF_CONFIG)
    hf_model = transformers.DeepseekV3ForCausalLM(config)
    _randomise(hf_model, seed=0)
    hf_model.save_pretrained(tmp_path)
    hf_model = _load_hf(tmp_path)
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path)

    ours = load_tokenizer(str(tmp_path))
    for text in TRICKY_TEXTS:
        assert ours.encode(text) == hf_tokenizer(text, add_special_tokens=False)["input_ids"]
        ids = ours.encode(text)
        assert ours.decode(ids) == hf_tokenizer.decode(ids, skip_special_tokens=True)
    assert (ours.bos_id, ours.eos_id, ours.pad_id) == (
        hf_tokenizer.bos_token_id,
        hf_tokenizer.eos_token_id,
        hf_tokenizer.pad_token_id,
    )
    # The chat template renders as transformers renders it.
    chat = chat_format_for(ours, system="Be brief.")
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Write f."},
        {"role": "assistant", "content": "<final>ok</final>"},
        {"role": "tool", "content": "[ok]"},
    ]
    _renders_like_transformers(chat, hf_tokenizer, messages, "Write f.", head=2)

    ours_model = interop.load_hf_checkpoint(tmp_path)
    _compare_greedy(hf_model, ours_model, ours)


# What a served model is asked: plain code, an agent's turn in the protocol, and text with
# special characters (each as the tokenizer's own encoding: bos first, as here).
CONTRACT_PROMPTS = (
    "def add(a, b):\n    return",
    'Make f(2) return 4.\n<think>f doubles?</think>\n<call tool="run_shell"><arg name="command">',
    "héllo wörld, ça va? 中文 😀 e\u0301 ß\t\r\n  ",
)
AGENT_TASK = "Make the failing test in tests/test_f.py pass."


def _trained_run(tmp_path, tokenizer_kind: str):
    """A tiny run trained 4 steps (one phase) with the byte tokenizer, the shipped BPE or an imported one."""
    corpus = make_corpus(str(tmp_path / "corpus"))
    cfg = tiny_experiment(str(tmp_path / "run"), corpus, steps=4, phases=ONE_PHASE)
    spec = {"byte": "byte", "shipped": "code_bpe_2k", "imported": str(tmp_path / "tok")}
    if tokenizer_kind == "imported":
        make_hf_folder(tmp_path / "tok", vocab_size=400)
    vocab = load_tokenizer(spec[tokenizer_kind]).vocab_size
    cfg = dataclasses.replace(
        cfg,
        model=dataclasses.replace(cfg.model, vocab_size=-(-vocab // 32) * 32),
        data=dataclasses.replace(cfg.data, tokenizer=spec[tokenizer_kind]),
    )
    run_pretraining(cfg, progress=False)
    return load_run(cfg.workdir)


@pytest.mark.parametrize("tokenizer_kind", ["byte", "shipped", "imported"])
def test_an_exported_run_generates_in_transformers_what_it_generates_here(tmp_path, tokenizer_kind):
    """The export contract: transformers encodes prompts as this project does (bos included),
    renders the run's chat template as it does, stops where it stops, and greedy-generates the
    same tokens from those encodings."""
    run = _trained_run(tmp_path, tokenizer_kind)
    out = tmp_path / "exported"
    interop.export_hf_checkpoint(run.model, out, run.tokenizer)
    hf_model = _load_hf(out)
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    ours = run.tokenizer
    for text in TRICKY_TEXTS:
        assert hf_tokenizer(text, add_special_tokens=False)["input_ids"] == ours.encode(text)
    prompts = [ours.encode(p, add_bos=True) for p in CONTRACT_PROMPTS]
    assert [hf_tokenizer(p)["input_ids"] for p in CONTRACT_PROMPTS] == prompts
    chat = chat_format_for(ours)
    if ours.chat_template:
        messages = [
            {"role": "user", "content": AGENT_TASK},
            {"role": "assistant", "content": "<think>read it</think>"},
            {"role": "tool", "content": "[ok] 1 passed"},
            {"role": "assistant", "content": "<final>done</final>"},
        ]
        agent_prompt = _renders_like_transformers(chat, hf_tokenizer, messages, AGENT_TASK, 1)
        prompts.append(agent_prompt)
    stops = list(chat.stop_token_ids)
    assert hf_model.generation_config.eos_token_id == (stops if len(stops) > 1 else stops[0])
    ours_model = interop.load_hf_checkpoint(out)  # float32, like the transformers model
    _compare_greedy(hf_model, ours_model, ours, prompts, stops)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_a_sharded_streamed_export_loads_in_transformers(tmp_path, dtype):
    """A model held over 8 devices, exported in several streamed shards, loads in transformers
    with nothing missing or unexpected, and its logits equal this project's from the same files."""
    from composer_jax import model
    from composer_jax.config import MeshConfig
    from composer_jax.parallel import make_layout
    from tests.interop.deepseek_checkpoint import write_checkpoint

    source = write_checkpoint(tmp_path / "source", fp8_block=None, mtp_layers=0)
    layout = make_layout(MeshConfig(fsdp=4, cp=2), jax.devices()[:8])
    sharded = interop.load_hf_checkpoint(source, layout=layout)
    out = tmp_path / "exported"
    interop.export_hf_checkpoint(sharded, out, dtype=dtype, shard_bytes=64 << 10)
    assert len(list(out.glob("*.safetensors"))) > 3
    hf_model = _load_hf(out)
    tokens = np.random.default_rng(0).integers(0, sharded.cfg.vocab_size, (2, 20))
    with torch.no_grad():
        want = hf_model(torch.tensor(tokens)).logits.numpy()
    got = np.asarray(model.compute_logits(interop.load_hf_checkpoint(out), tokens))
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-4)
