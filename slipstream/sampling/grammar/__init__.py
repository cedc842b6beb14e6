"""Grammar-constrained decoding: a backend compiles a request's StructuredOutputsParams into a
grammar (backend.py, one file per backend), `GrammarCompiler` compiles off the caller's thread
with an LRU cache (compiler.py), a `GrammarMatcher` follows one request's tokens and writes its
row of the token bitmask (matcher.py), and bitmask.py allocates and applies that bitmask."""
