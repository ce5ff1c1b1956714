"""The file formats models and drafters come in, read and written: a Hugging Face folder (GPT-2's,
the Llama family's), a GGUF file (llama.cpp's) with its tokenizer and chat template, and a
drafter's speculators folder (what vLLM serves)."""
