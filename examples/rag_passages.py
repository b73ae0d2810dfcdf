"""Retrieved passages reused at any position: the second prompt holds the same passages
in another order, so their KV comes from the passage cache."""

from kvboost_rag import KVBoost

engine = KVBoost.from_pretrained("smollm2-135m-instruct")  # fidelity="balanced"
docs = [
    "The Eiffel Tower is in Paris and was finished in 1889.",
    "The Colosseum is in Rome and could hold about 50,000 people.",
    "Big Ben is the nickname of the great bell in London's Elizabeth Tower.",
]
for order in (docs, docs[::-1]):
    result = engine.generate(
        "Question: when was the Eiffel Tower finished?\nAnswer:", passages=order, max_new_tokens=16
    )
    print(repr(result.text))
    print(
        f"  ttft {result.ttft_ms:.0f} ms, passages hit {result.passages_hit} "
        f"({result.passages_foreign} foreign) / missed {result.passages_missed}, "
        f"reused {result.reused_tokens}/{result.prompt_tokens}"
    )
