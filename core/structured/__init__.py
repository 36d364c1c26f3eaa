"""Structured outputs: grammar-constrained decoding with xgrammar (JSON schema, any JSON object, regex, a
choice among strings, EBNF). ``params`` is the request field (``SamplingParams.structured``), ``grammar``
compiles a request's constraint against a tokenizer's vocabulary (cached by constraint) and keeps each
request's matcher, whose token bitmask the ``sample.mask`` op applies to the logits."""
