"""Media prompts on the engine core (issue 15): Qwen2.5-VL images and video, Qwen2.5-Omni audio. The core's greedy
tokens and log-probs equal the Hugging Face path's and the training forward's; media with equal token ids are
never confused by the prefix cache; a GRPO group of one media prompt computes it once; preemption recomputes
a media prompt from its features."""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image
from transformers import AutoTokenizer

from relax.backends.inference.base import GenerationRequest, SamplingParams
from relax.backends.inference.embedded import CoreSettings, EmbeddedEngine
from relax.backends.inference.engine_core.media import media_key
from relax.backends.models.family import MediaTokens, forward_inputs, load_model
from tests.support.tiny_mm_assets import build_tiny_omni, build_tiny_vl, omni_processor, vl_processor

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

# float32 on CPU: the core and the Hugging Face path differ by about 1e-6 per token log-prob; a 3D rope with the
# height and width axes wrong moves them by ~3e-5 on these tiny models, so the bound must stay well below that.
TOLERANCE = 5e-6


def _image(count: int, size: int = 56) -> Image.Image:
    from PIL import ImageDraw

    image = Image.new("RGB", (size, size), "white")
    draw = ImageDraw.Draw(image)
    for k in range(count):
        x, y = (k % 2) * size // 2 + 4, (k // 2) * size // 2 + 4
        draw.rectangle((x, y, x + size // 4, y + size // 4), fill="black")
    return image


def _tone(frequency: float, seconds: float = 1.0) -> np.ndarray:
    t = np.arange(int(16000 * seconds)) / 16000
    return (0.3 * np.sin(2 * np.pi * frequency * t)).astype(np.float32)


class Family:
    """A tiny multimodal model with its processor: ``prompt(item)`` gives (input_ids, processor tensors)."""

    def __init__(self, kind: str, tmp_path) -> None:
        folder = build_tiny_omni(tmp_path) if kind == "audio" else build_tiny_vl(tmp_path)
        self.kind = kind
        self.tokenizer = AutoTokenizer.from_pretrained(folder)
        self.model = load_model(folder, torch.float32)
        self.processor = omni_processor(folder) if kind == "audio" else vl_processor(folder)

    def prompt(self, item, question: str = "How many?") -> tuple[list[int], dict[str, torch.Tensor]]:
        kind = "audio" if self.kind == "audio" else "image"
        messages = [{"role": "user", "content": [{"type": kind}, {"type": "text", "text": question}]}]
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        media = {"audio": [item]} if kind == "audio" else {"images": [item]}
        batch = self.processor(text=[text], return_tensors="pt", **media)
        inputs = {k: v for k, v in batch.items() if k not in ("input_ids", "attention_mask", "mm_token_type_ids")}
        return batch["input_ids"][0].tolist(), inputs

    def items(self) -> list:
        if self.kind == "audio":
            return [_tone(220.0), _tone(880.0), _tone(440.0, 0.5)]
        return [_image(1), _image(3), _image(4, size=84)]

    def engine(self, mode: str = "on", **settings) -> EmbeddedEngine:
        return EmbeddedEngine(self.model, self.tokenizer,
                              core=CoreSettings(mode=mode, **{"max_total_tokens": 4096, **settings}))


@pytest.fixture(scope="module", params=["image", "audio"])
def family(request, tmp_path_factory):
    return Family(request.param, tmp_path_factory.mktemp(request.param))


def _request(rid: str, ids: list[int], inputs: dict | None, **params) -> GenerationRequest:
    params = {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True, **params}
    return GenerationRequest(rid, ids, SamplingParams(**params), multimodal_inputs=inputs)


def _forward_log_probs(family: Family, ids: list[int], inputs: dict | None, outputs: list[int],
                       temperature: float) -> torch.Tensor:
    """The training forward's log-prob of each output token, media placeholders and the boundaries around media
    masked as the engine masks them (a model never writes one)."""
    full = torch.tensor([ids + outputs])
    kwargs = forward_inputs(family.model, inputs, full, full.device, torch.float32) if inputs else {}
    with torch.no_grad():
        logits = family.model(input_ids=full, **kwargs).logits[0, len(ids) - 1:-1].float()
    logits[:, MediaTokens.of(family.model.config).never_generated] = float("-inf")
    logits = logits / (temperature or 1.0)
    return logits.log_softmax(-1).gather(1, torch.tensor(outputs)[:, None])[:, 0]


def test_the_core_runs_media_prompts_as_the_hugging_face_path_does(family):
    """Three media items (two samples each) and a text-only prompt in one call: greedy tokens equal, log-probs
    equal to rounding, every sample of a prompt alike, and the prompts' blocks all back in the pool."""
    requests = []
    for index, item in enumerate(family.items()):
        ids, inputs = family.prompt(item)
        requests += [_request(f"m{index}.{k}", ids, inputs) for k in range(2)]
    text_ids = family.tokenizer("higher lower left right", add_special_tokens=False)["input_ids"]
    requests.append(_request("text", text_ids, None))
    core = family.engine("on")
    assert core.core is not None and core.core.media is not None
    on = asyncio.run(core.generate(requests))
    off = asyncio.run(family.engine("off").generate(requests))
    assert [o.output_ids for o in on] == [o.output_ids for o in off]
    for a, b in zip(on, off):
        assert a.output_log_probs == pytest.approx(b.output_log_probs, abs=TOLERANCE)
    assert len({tuple(o.output_ids) for o in on[:6:2]}) > 1  # the media change the answer
    blocks = core.core.blocks
    assert blocks.num_free == blocks.num_blocks - 1


def test_the_encoder_gives_the_models_own_merge_and_3d_rope(family):
    """Against the pieces the Hugging Face path uses: the model's rope index and rotary module, and its forward's
    embeddings of the media rows."""
    from relax.backends.models.family import rope_positions

    core = family.engine("on")
    ids, inputs = family.prompt(family.items()[2])
    prompt = core.core.media.encode(ids, inputs)
    full = torch.tensor([ids])
    positions = rope_positions(family.model, full, torch.ones_like(full), inputs)
    assert positions is not None
    if family.kind == "image":  # a real 3D layout (audio positions agree on all three axes)
        assert not torch.equal(positions[0], positions[1])
    text_model = core.core.runner.decoder.text_model
    cos, sin = text_model.rotary_emb(torch.zeros(1, dtype=torch.float32), positions)
    assert torch.equal(prompt.cos, cos[0]) and torch.equal(prompt.sin, sin[0])
    assert prompt.rope_delta == int(positions.max()) + 1 - len(ids)
    captured = {}
    handle = text_model.register_forward_pre_hook(
        lambda module, args, kwargs: captured.update(kwargs), with_kwargs=True)
    with torch.no_grad():
        family.model(input_ids=full, **forward_inputs(family.model, inputs, full, full.device, torch.float32))
    handle.remove()
    media_rows = [i for i, t in enumerate(ids) if t in MediaTokens.of(family.model.config).ids]
    assert prompt.rows.tolist() == media_rows
    assert torch.equal(prompt.features, captured["inputs_embeds"][0, media_rows])


def test_sampled_log_probs_equal_the_training_forward(family):
    core = family.engine("on")
    requests = []
    for index, item in enumerate(family.items()):
        ids, inputs = family.prompt(item)
        requests.append(_request(f"s{index}", ids, inputs, temperature=0.8, seed=index, max_new_tokens=12))
    for req, out in zip(requests, asyncio.run(core.generate(requests))):
        reference = _forward_log_probs(family, req.input_ids, req.multimodal_inputs, out.output_ids, 0.8)
        assert out.output_log_probs == pytest.approx(reference.tolist(), abs=2 * TOLERANCE)


def test_greedy_outputs_equal_model_generate(family):
    """`model.generate` greedy, media placeholders and boundaries suppressed (the engine never writes them)."""
    core = family.engine("on")
    media_ids = MediaTokens.of(family.model.config).never_generated
    for index, item in enumerate(family.items()[:2]):
        ids, inputs = family.prompt(item)
        (out,) = asyncio.run(core.generate([_request(f"g{index}", ids, inputs, max_new_tokens=6)]))
        full = torch.tensor([ids])
        kwargs = forward_inputs(family.model, inputs, full, full.device, torch.float32)
        expected = family.model.generate(input_ids=full, attention_mask=torch.ones_like(full), max_new_tokens=6,
                                         do_sample=False, suppress_tokens=media_ids, eos_token_id=None, **kwargs)
        assert out.output_ids == expected[0, len(ids):].tolist()


def test_equal_token_ids_with_other_media_never_share_blocks(family):
    """Two items with the same placeholder count give the same token ids: the second call must compute its
    prompt from the first placeholder on, and answer as a fresh engine does."""
    first, second = family.items()[:2]
    ids_a, inputs_a = family.prompt(first)
    ids_b, inputs_b = family.prompt(second)
    assert ids_a == ids_b
    core = family.engine("on", page_size=4)
    asyncio.run(core.generate([_request("a", ids_a, inputs_a)]))
    before = core.core.runner.prefill_tokens
    (b_after_a,) = asyncio.run(core.generate([_request("b", ids_b, inputs_b)]))
    placeholder = next(i for i, t in enumerate(ids_b) if t in core.core.media.placeholder_ids)
    assert core.core.runner.prefill_tokens - before == len(ids_b) - placeholder // 4 * 4
    (b_fresh,) = asyncio.run(family.engine("on").generate([_request("b", ids_b, inputs_b)]))
    assert b_after_a.output_ids == b_fresh.output_ids
    assert b_after_a.output_log_probs == pytest.approx(b_fresh.output_log_probs, abs=1e-5)
    # the very same media again (other tensor objects) reuse every full block but the last token's
    before = core.core.runner.prefill_tokens
    _, inputs_b_again = family.prompt(second)
    asyncio.run(core.generate([_request("b2", ids_b, inputs_b_again)]))
    assert core.core.runner.prefill_tokens - before == len(ids_b) - (len(ids_b) - 1) // 4 * 4


def test_a_group_of_one_media_prompt_computes_it_once(family):
    ids, inputs = family.prompt(family.items()[0])
    core = family.engine("on")
    outputs = asyncio.run(core.generate([_request(f"g{i}", ids, inputs, temperature=1.0, seed=3, max_new_tokens=10)
                                         for i in range(6)]))
    assert core.core.runner.prefill_tokens == len(ids)
    assert len({tuple(o.output_ids) for o in outputs}) > 1


def test_preempted_media_prompts_are_recomputed_from_their_features(family):
    requests = []
    for index, item in enumerate(family.items()):
        ids, inputs = family.prompt(item)
        requests.append(_request(f"p{index}", ids, inputs, max_new_tokens=40))
    roomy = asyncio.run(family.engine("on").generate(requests))
    longest = max(len(r.input_ids) for r in requests) + 40
    tight = family.engine("on", max_total_tokens=-(-longest // 4) * 4 + 8, page_size=4)
    squeezed = asyncio.run(tight.generate(requests))
    assert tight.core.scheduler.preemptions > 0
    assert [o.output_ids for o in squeezed] == [o.output_ids for o in roomy]
    for a, b in zip(squeezed, roomy):
        assert a.output_log_probs == pytest.approx(b.output_log_probs, abs=TOLERANCE)


def test_media_on_a_text_model_are_refused_naming_the_request():
    from tests.backends.inference.test_embedded_engine import make_model, make_tokenizer

    engine = EmbeddedEngine(make_model(seed=0), make_tokenizer(), core=CoreSettings(mode="on"))
    request = _request("pic", [5, 6, 7], {"pixel_values": torch.zeros(4, 8)})
    with pytest.raises(ValueError, match="'pic' has media, and Qwen3ForCausalLM takes none"):
        asyncio.run(engine.generate([request]))
    assert engine.core.in_flight == 0


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(0, 255), min_size=1, max_size=64), st.lists(st.integers(0, 255), min_size=1, max_size=64),
       st.sampled_from([torch.float32, torch.bfloat16, torch.int64]))
def test_media_keys_follow_content_not_identity(a, b, dtype):
    first = {"pixel_values": torch.tensor(a).to(dtype)}
    again = {"pixel_values": torch.tensor(list(a)).to(dtype)}
    other = {"pixel_values": torch.tensor(b).to(dtype)}
    assert media_key(first) == media_key(again)
    assert (media_key(first) == media_key(other)) == torch.equal(first["pixel_values"], other["pixel_values"])
    assert media_key(first) != media_key({"pixel_values_videos": first["pixel_values"]})
    assert 0 <= media_key(first) < 2**62


def test_video_prompts_run_on_the_core(tmp_path):
    """Qwen2.5-VL video through the data path (temporal rope positions with seconds per grid): the core and the
    Hugging Face path agree."""
    from transformers import AutoConfig

    from relax.data.multimodal import MultimodalSettings
    from relax.data.sample import Sample
    from relax.rollout.generation.multimodal import MultimodalPreparer
    from tests.support.tiny_mm_assets import make_video_rows

    family = Family("image", tmp_path)
    folder = tmp_path / "tiny_vl"
    rows_path = make_video_rows(tmp_path, 2)
    rows = [json.loads(line) for line in rows_path.read_text().splitlines()]
    preparer = MultimodalPreparer(family.tokenizer, AutoConfig.from_pretrained(folder), folder,
                                  MultimodalSettings(video_min_token_num=4, video_max_token_num=16), None, {},
                                  pool_size=1, skip_bad_samples=False)
    samples = [Sample(index=i, prompt=row["prompt"],
                      multimodal_inputs={"video": [str(rows_path.parent / item) for item in row["videos"]]})
               for i, row in enumerate(rows)]
    ready, _ = asyncio.run(preparer.prepare(samples))
    preparer.close()
    assert all("pixel_values_videos" in s.multimodal_train_inputs for s in ready)
    requests = [_request(f"v{s.index}", s.tokens, s.multimodal_train_inputs) for s in ready]
    on = asyncio.run(family.engine("on").generate(requests))
    off = asyncio.run(family.engine("off").generate(requests))
    assert [o.output_ids for o in on] == [o.output_ids for o in off]
    for a, b in zip(on, off):
        assert a.output_log_probs == pytest.approx(b.output_log_probs, abs=TOLERANCE)
