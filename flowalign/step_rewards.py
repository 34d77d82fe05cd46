"""Per-step rewards as public pure functions: DenseGRPO's increments, the return to go, TP-GRPO's turning points
(the paper's reading and the released code's) and DenseGRPO's noise calibration.

A thin public module over the credit layer's math (``flowalign.credit.step_rewards``, ``flowalign.credit.tp_grpo``),
so the functions are imported from one stable place: ``from flowalign.step_rewards import tp_grpo_process_rewards``.
"""

from flowalign.credit.step_rewards import (
    ESTIMATORS,
    calibrate_noise,
    dense_increments,
    return_to_go,
    turning_point_rewards,
)
from flowalign.credit.tp_grpo import RELEASED_OPTIONS, released_process_rewards, tp_grpo_process_rewards

__all__ = ["ESTIMATORS", "RELEASED_OPTIONS", "calibrate_noise", "dense_increments", "released_process_rewards",
           "return_to_go", "tp_grpo_process_rewards", "turning_point_rewards"]
