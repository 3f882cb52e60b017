"""Curvature operators: the contract every estimator takes (:mod:`.linear_operator`), the Hessian of a model's loss
(:mod:`.hessian`) with its product strategies (:mod:`.products`), the Gauss-Newton matrix and the empirical Fisher
(:mod:`.curvatures`; cross-entropy's output Hessian in closed form: :mod:`.cross_entropy`), the names of the
curvatures and product methods (:mod:`.names`), the evaluation set (:mod:`.batches`), random vectors and free memory
(:mod:`.vectors`), any objective (:mod:`.objective`), operations without a second derivative (:mod:`.second_order`)
and an operator over several ranks (:mod:`.distributed`). Nothing is imported here:
``from flatfl.analysis import HessianOperator`` imports what it needs."""
