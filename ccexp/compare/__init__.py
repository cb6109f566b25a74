"""The statistics of a comparison and its verdict: paired means and 95 % CIs over seeds, seeds needed for a
given effect, the budget study, and the comparison report built from them."""
