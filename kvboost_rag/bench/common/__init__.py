"""What the benchmarks share: corpora, baselines, metrics, charts, the machine they ran
on, local Redis servers."""
