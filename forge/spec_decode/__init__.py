"""Speculative decoding: the method's settings and n-gram proposals, a draft model's guesses, the step budget
guesses may take."""
