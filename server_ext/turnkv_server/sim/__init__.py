"""`turnkv sim`: a discrete-event model of a fleet (engines, their KV caches and host tiers, the
links between them, routers) serving multi-turn sessions, on SimPy.

The policies it runs are turnkv's own, imported: the planner (`router.planner`, its weighing
`router.weighing`) and its cost model's shape (`router.planner.CostModel`), the lease order by
expected return (`connector.leases`) and admission (`router.admission.fits`). Nothing in
the product imports this package. docs/simulator.md says what it models and what it leaves out.
"""
