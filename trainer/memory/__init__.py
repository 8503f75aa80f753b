"""Memory: what a run needs (the estimate), the budget a card gives, the ladder of savers and the plan that fits."""
