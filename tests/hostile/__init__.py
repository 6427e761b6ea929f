"""Hostile inputs: the committed corpus (corpus/, written by make_corpus.py) and the generators the tests share."""
