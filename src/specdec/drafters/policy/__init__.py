"""The adaptive method's policy, apart from the drafter that runs it (drafters/auto.py).

    config.py     the tunables (PolicyConfig), today's measured settings as defaults
    priors.py     the fitted priors, read once from specdec/data/drafting_priors.json
    estimates.py  what is learned online: acceptance per source, the draft's time scale, shadows
    pricing.py    what a proposal yields and costs (also the machine profile's pricing)
    planner.py    each round's choice, pure: plan(offers, estimates, costs, config, k) -> Option
"""
