"""End to end on the embedded Gemma 3 270M (fp32): sliding-window layers (512 tokens) with
local and global RoPE bases, prompts longer than the window."""

import pytest
import torch

from kvboost_rag import KVBoost, KVBoostConfig, passage
from kvboost_rag.core.model.embedded import EMBEDDED_MODELS, embedded_available

pytestmark = [
    pytest.mark.embedded,
    pytest.mark.skipif(
        not embedded_available("gemma3-270m"),
        reason=f"needs the Gemma 3 270M packages: {EMBEDDED_MODELS['gemma3-270m'].install}",
    ),
]

NOTES = [
    "The Danube is Europe's second-longest river. It rises in the Black Forest of Germany and "
    "flows for about 2,850 kilometres through ten countries before emptying into the Black Sea "
    "through a wide delta. Four capital cities lie on its banks: Vienna, Bratislava, Budapest "
    "and Belgrade. For centuries it was a frontier of the Roman Empire and a trade route.",
    "Mount Kilimanjaro, in northeastern Tanzania, is the highest mountain in Africa at 5,895 "
    "metres. It is a dormant volcano made of three cones: Kibo, Mawenzi and Shira. Climbers "
    "need five to nine days to reach Uhuru Peak, passing through rainforest, heath, alpine "
    "desert and an arctic summit zone. Its glaciers have shrunk by more than eighty percent.",
    "The Atacama Desert in northern Chile is one of the driest places on Earth. Some weather "
    "stations there have never recorded rain. Its high altitude, clear skies and lack of light "
    "pollution make it home to several of the largest observatories in the world, including "
    "the Atacama Large Millimeter Array and the Very Large Telescope at Paranal.",
    "Lake Baikal in southern Siberia is the deepest lake in the world, reaching 1,642 metres, "
    "and the oldest, at about 25 million years. It holds roughly a fifth of the planet's "
    "unfrozen fresh surface water. More than a thousand of its species live nowhere else, "
    "including the Baikal seal. In winter roads are marked across its ice.",
    "The Amazon rainforest covers about five and a half million square kilometres across nine "
    "countries, most of it in Brazil. It holds around ten percent of the known species on "
    "Earth, and the Amazon River that drains it carries more water than the next seven "
    "largest rivers combined. Large areas have been cleared for cattle and soy since 1970.",
    "Iceland sits on the Mid-Atlantic Ridge, where the North American and Eurasian plates "
    "pull apart. Volcanoes and geysers are common, and geothermal plants heat almost nine in "
    "ten homes. The word geyser comes from Geysir, a hot spring in the Haukadalur valley whose "
    "eruptions once threw water seventy metres into the air.",
    "The Great Barrier Reef off Queensland, Australia, is the largest coral reef system in the "
    "world, stretching over 2,300 kilometres and made of nearly three thousand individual "
    "reefs. It can be seen from space. Warming seas have caused several mass bleaching "
    "events since 1998, in which corals expel the algae that feed them and turn white.",
    "The Sahara is the largest hot desert, covering about nine million square kilometres of "
    "North Africa. Most of it is stony plateau rather than sand dunes. Around six thousand "
    "years ago it was green, with lakes, grasslands and hippos, until a slow shift in the "
    "Earth's orbit weakened the monsoon that watered it.",
]
QUESTION = "Which of these places is the driest, and why do astronomers like it?"


def messages(order: list[int]) -> list[dict]:
    notes = "\n\n".join(passage(NOTES[i]) for i in order)
    return [{"role": "user", "content": f"Answer from these notes.\n\n{notes}\n\n{QUESTION}"}]


def full_logits(engine: KVBoost, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return engine.model(torch.tensor([tokens])).logits[0, -1].float()


@pytest.fixture(scope="module")
def gemma() -> KVBoost:
    # its float weights: the tests below hold the exact path to full prefill's logits, which
    # the blocks' int8 inputs round per forward (``docs/guides/models.md``)
    return KVBoost.from_pretrained("gemma3-270m", dtype=torch.float32, weights="dense")


def test_by_default_it_runs_on_its_file_s_blocks_and_answers_as_the_float_weights(
    gemma: KVBoost,
) -> None:
    blocks = KVBoost.from_pretrained("gemma3-270m", dtype=torch.float32)
    assert blocks.inspect.profile().weights == "int4-gguf,int6-gguf,int8-gguf"  # Q4_K_M
    assert gemma.inspect.profile().weights == "checkpoint"
    history = messages([2, 7, 5, 0, 3, 6, 1, 4])
    # the base model's answer (the Sahara, wrong) is the float weights' to the last token
    ours = blocks.chat(history, max_new_tokens=16)
    assert ours.token_ids == gemma.chat(history, max_new_tokens=16).token_ids


def test_structure_is_read_from_the_model(gemma: KVBoost) -> None:
    support = gemma.support
    assert support.passage_reuse and support.sliding_window == 512
    kinds = [rotary.layer_type for rotary in support.rotaries]
    assert kinds == list(gemma.model.config.layer_types) and "full_attention" in kinds


def test_reordered_passages_are_hits_and_stay_close(gemma: KVBoost) -> None:
    gemma.clear_cache()
    first = gemma.chat(messages(list(range(8))), max_new_tokens=4)
    assert first.prompt_tokens > 512  # past the sliding window
    assert (first.passages_hit, first.passages_missed) == (0, 8)  # cold: prefilled plainly
    reordered = messages([2, 7, 5, 0, 3, 6, 1, 4])
    second = gemma.chat(reordered, max_new_tokens=4)
    assert (second.passages_hit, second.passages_missed) == (8, 0)
    assert second.reused_tokens > second.prompt_tokens // 2
    ref = torch.log_softmax(full_logits(gemma, gemma.tokenize_chat(reordered)), -1)
    ours = torch.log_softmax(gemma.first_token_logits(reordered), -1)
    assert int(ours.argmax()) == int(ref.argmax())
    assert float((ref.exp() * (ref - ours)).sum()) < 0.05  # measured ~1e-3


def test_exact_path_equals_full_prefill(gemma: KVBoost) -> None:
    exact = KVBoost(gemma.model, gemma.tokenizer, KVBoostConfig(fidelity="exact"))
    history = messages(list(range(8)))
    exact.chat(history, max_new_tokens=2)
    follow = [
        *history,
        {"role": "assistant", "content": "The Atacama Desert."},
        {"role": "user", "content": "And which lake is the deepest?"},
    ]
    tokens = exact.tokenize_chat(follow)
    torch.testing.assert_close(
        exact.first_token_logits(follow), full_logits(exact, tokens), atol=1e-3, rtol=0
    )
    result = exact.chat(follow, max_new_tokens=8)
    assert result.reused_tokens > 512
    ids = torch.tensor([tokens])
    expected = exact.model.generate(ids, max_new_tokens=8, do_sample=False)[0, ids.shape[1] :]
    assert result.token_ids == expected.tolist()[: len(result.token_ids)]
