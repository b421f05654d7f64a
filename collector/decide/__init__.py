"""Findings in, actions out: prediction, cost model, policy, orders, webhooks, drains."""
