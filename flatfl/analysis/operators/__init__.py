"""Curvature operators: the contract every estimator takes (:mod:`.linear_operator`), the Hessian of a model's loss
(:mod:`.hessian`) with its product strategies (:mod:`.products`), the Gauss-Newton matrix and the empirical Fisher
(:mod:`.curvatures`), the evaluation set (:mod:`.batches`), any objective (:mod:`.objective`), operations without a
second derivative (:mod:`.second_order`) and an operator over several ranks (:mod:`.distributed`). Nothing is
imported here: ``from flatfl.analysis import HessianOperator`` imports what it needs."""
