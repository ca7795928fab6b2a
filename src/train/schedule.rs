//! Learning-rate schedules as pure functions of the step (0-based optimizer step, `total` steps).
//!
//! ```text
//! warmup   (s < W):      lr · (s + 1) / W
//! constant (s ≥ W):      lr
//! cosine   (s ≥ W):      lr · [m + (1 − m) · ½ (1 + cos(π p))],   p = (s − W) / (total − 1 − W)
//! WSD      (s ≥ W):      lr until D = total − ⌈f·total⌉, then lr · [1 − (1 − m) · (s − D + 1) / (total − D)]
//! ```
//! `m` = `min_lr_ratio`, `f` = `decay_fraction`. Cosine reaches `m · lr` exactly at the last step; WSD
//! decays linearly over its last `f` of the run and also ends at `m · lr`.

use crate::recipe::ScheduleConfig;
use std::f64::consts::PI;

/// Learning rate at optimizer step `step` of `total`, for peak rate `lr`.
pub fn lr_at(schedule: &ScheduleConfig, lr: f64, step: usize, total: usize) -> f64 {
    let warmup = match schedule {
        ScheduleConfig::Constant { warmup_steps }
        | ScheduleConfig::Cosine { warmup_steps, .. }
        | ScheduleConfig::Wsd { warmup_steps, .. } => *warmup_steps,
    };
    if step < warmup {
        return lr * (step + 1) as f64 / warmup as f64;
    }
    match schedule {
        ScheduleConfig::Constant { .. } => lr,
        ScheduleConfig::Cosine { min_lr_ratio, .. } => {
            let span = total.saturating_sub(1 + warmup).max(1) as f64;
            let p = ((step - warmup) as f64 / span).min(1.0);
            lr * (min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + (PI * p).cos()))
        }
        ScheduleConfig::Wsd {
            decay_fraction,
            min_lr_ratio,
            ..
        } => {
            let decay_steps =
                ((decay_fraction * total as f64).ceil() as usize).clamp(1, total.max(1));
            let decay_start = total - decay_steps;
            if step < decay_start {
                lr
            } else {
                let p = ((step - decay_start + 1) as f64 / decay_steps as f64).min(1.0);
                lr * (1.0 - (1.0 - min_lr_ratio) * p)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() < 1e-12 * b.abs().max(1.0)
    }

    #[test]
    fn warmup_is_linear_from_one_step() {
        let s = ScheduleConfig::Constant { warmup_steps: 4 };
        let lrs: Vec<f64> = (0..6).map(|i| lr_at(&s, 1.0, i, 10)).collect();
        assert_eq!(lrs, vec![0.25, 0.5, 0.75, 1.0, 1.0, 1.0]);
    }

    #[test]
    fn cosine_peaks_after_warmup_and_ends_at_the_floor() {
        let s = ScheduleConfig::Cosine {
            warmup_steps: 10,
            min_lr_ratio: 0.1,
        };
        assert!(close(lr_at(&s, 2.0, 10, 110), 2.0));
        assert!(close(lr_at(&s, 2.0, 109, 110), 0.2));
        assert!(close(
            lr_at(&s, 2.0, 60, 110),
            2.0 * (0.1 + 0.9 * 0.5 * (1.0 + (PI * 50.0 / 99.0).cos()))
        ));
        let lrs: Vec<f64> = (10..110).map(|i| lr_at(&s, 2.0, i, 110)).collect();
        assert!(lrs.windows(2).all(|w| w[1] <= w[0]), "monotone decay");
    }

    #[test]
    fn wsd_is_flat_then_decays_over_its_last_fraction() {
        let s = ScheduleConfig::Wsd {
            warmup_steps: 5,
            decay_fraction: 0.2,
            min_lr_ratio: 0.0,
        };
        // 100 steps: stable until step 80, then 20 linear steps ending at 0.
        assert!(close(lr_at(&s, 1.0, 79, 100), 1.0));
        assert!(close(lr_at(&s, 1.0, 80, 100), 0.95));
        assert!(close(lr_at(&s, 1.0, 99, 100), 0.0));
    }
}
