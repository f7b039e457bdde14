"""Prompt sets shared by the prefix planner's tests."""

from hypothesis import strategies as st

SPEC = [  # the spec's five reviews, one token a word
    [10, 20, 30, 40],
    [10, 20, 30, 50, 60, 70],
    [80, 90, 70],
    [10, 20, 30, 50],
    [10, 20, 30, 50],
]

# A small alphabet and short prompts share a lot: copies, prefixes of one another, one-token
# prompts.
tokens = st.lists(st.integers(0, 2), min_size=1, max_size=10)
prompt_sets = st.lists(tokens, max_size=25)
page_sizes = st.integers(1, 4)
