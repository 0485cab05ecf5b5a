//! RFC 2544's throughput search (§26.1): the highest rate a device forwards with no more than
//! a given share of its frames lost, found by binary search over trials of fixed length. The
//! search is pure: a trial is whatever the caller runs at a rate.
//!
//! On shared CPUs one trial can lose frames to a stall of the host, not of the device (a
//! millisecond's preemption of a polling core overflows its rings): each rate is judged by the
//! majority of up to `trials_per_rate` trials, stopping as soon as the majority is known (so a
//! device that passes or fails steadily costs two trials per rate). This is MLRsearch's rule
//! with an exceed ratio of one half (the search CSIT reports, RFC 9682's draft family); with
//! one trial per rate it is RFC 2544's.

use anyhow::Result;

/// What one trial at a rate gave.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct Outcome {
    /// Frames per second the tester offered (it may fall short of the rate asked for).
    pub offered_pps: f64,
    /// Frames lost over frames sent.
    pub loss_ratio: f64,
}

/// The bounds of a search.
#[derive(Debug, Clone, Copy)]
pub struct Bounds {
    /// The highest rate tried first; a search that loses more at it looks below.
    pub max_pps: f64,
    /// The search stops when the rates that passed and failed are this close.
    pub resolution_pps: f64,
    /// The most of a trial's frames that may be lost for the rate to pass (0.00001 for the
    /// no-drop rate, 0.001 for the partial-drop rate).
    pub loss_ratio: f64,
    /// A rate known to pass (the no-drop rate, for the partial-drop search): the search
    /// looks above it only.
    pub passes_at_pps: f64,
    /// Trials at most per rate; the majority decides (odd numbers avoid ties; 1 is RFC 2544).
    pub trials_per_rate: usize,
}

/// A trial passes only if the tester offered at least this share of the rate asked for: below
/// it, the tester (not the device) set the pace, and the rate was not tried.
const OFFERED_AT_LEAST: f64 = 0.98;

/// What a search found: the highest rate that passed (0 when none did), every trial in the
/// order run, and whether the tester could not offer more than it (the device may do better).
#[derive(Debug, Clone, serde::Serialize)]
pub struct Found {
    pub rate_pps: f64,
    pub trials: Vec<(f64, Outcome)>,
    pub tester_limited: bool,
}

/// The trials run so far and what they showed.
#[derive(Default)]
struct Log {
    trials: Vec<(f64, Outcome)>,
    /// The tester fell short of a rate.
    short: bool,
    /// The device lost too much at a rate the tester did offer.
    device_failed: bool,
}

impl Log {
    /// Whether `rate` passes by the majority of its trials; and the least the tester offered.
    ///
    /// A trial the tester could not pace (a stall of the tester's own core) says nothing of the
    /// device: once another trial at the rate was paced, it is run again, up to
    /// `trials_per_rate` times more, instead of counting as a failure. A tester that paces no
    /// trial at the rate fails it as before, after a majority of trials.
    fn judge(
        &mut self,
        rate: f64,
        bounds: &Bounds,
        trial: &mut impl FnMut(f64) -> Result<Outcome>,
    ) -> Result<(bool, f64)> {
        let needed = bounds.trials_per_rate / 2 + 1;
        let (mut passed, mut failed, mut short, mut offered) = (0, 0, 0, f64::INFINITY);
        while passed < needed && failed < needed {
            let o = trial(rate)?;
            self.trials.push((rate, o));
            offered = offered.min(o.offered_pps);
            let tester_kept_up = o.offered_pps >= rate * OFFERED_AT_LEAST;
            let kept = o.loss_ratio <= bounds.loss_ratio;
            self.short |= !tester_kept_up;
            self.device_failed |= tester_kept_up && !kept;
            match (tester_kept_up, kept) {
                (true, true) => passed += 1,
                (true, false) => failed += 1,
                (false, _) => {
                    short += 1;
                    let paced = passed + failed > 0;
                    // The rate fails: no majority of passes came.
                    if (!paced && short >= needed) || short > bounds.trials_per_rate {
                        break;
                    }
                }
            }
        }
        Ok((passed >= needed, offered))
    }
}

/// Searches the rates up to `bounds.max_pps` with `trial` (which runs the device at a rate).
/// The first rate tried is the maximum; if the tester offered less there, the search stays
/// below what it offered.
pub fn highest_rate(
    bounds: Bounds,
    mut trial: impl FnMut(f64) -> Result<Outcome>,
) -> Result<Found> {
    anyhow::ensure!(bounds.max_pps > 0.0, "the highest rate must be positive");
    anyhow::ensure!(
        bounds.resolution_pps > 0.0,
        "the search resolution must be positive"
    );
    anyhow::ensure!(bounds.trials_per_rate > 0, "at least one trial per rate");
    let mut log = Log::default();
    let (top_passed, offered) = log.judge(bounds.max_pps, &bounds, &mut trial)?;
    let top = offered.min(bounds.max_pps);
    // Nothing lost at the top, or only the tester's pace fell short there: the device keeps
    // up with all the tester sends.
    let kept_all = log
        .trials
        .iter()
        .all(|(_, o)| o.loss_ratio <= bounds.loss_ratio);
    if top_passed || (log.short && kept_all) {
        return Ok(Found {
            rate_pps: top,
            trials: log.trials,
            tester_limited: true,
        });
    }
    let (mut passed, mut failed) = (bounds.passes_at_pps.min(top), top);
    while failed - passed > bounds.resolution_pps {
        let rate = (passed + failed) / 2.0;
        if log.judge(rate, &bounds, &mut trial)?.0 {
            passed = rate;
        } else {
            failed = rate;
        }
    }
    Ok(Found {
        rate_pps: passed,
        trials: log.trials,
        tester_limited: log.short && !log.device_failed,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bounds(max_pps: f64, resolution_pps: f64, loss_ratio: f64, passes_at_pps: f64) -> Bounds {
        Bounds {
            max_pps,
            resolution_pps,
            loss_ratio,
            passes_at_pps,
            trials_per_rate: 1,
        }
    }

    /// A device that forwards up to `capacity` frames per second and drops the excess.
    fn device(capacity: f64) -> impl FnMut(f64) -> Result<Outcome> {
        move |rate| {
            Ok(Outcome {
                offered_pps: rate,
                loss_ratio: ((rate - capacity) / rate).max(0.0),
            })
        }
    }

    #[test]
    fn the_search_finds_a_capacity_within_its_resolution() {
        for capacity in [1_000.0, 123_456.0, 999_000.0] {
            let bounds = bounds(1_000_000.0, 1_000.0, 0.0, 0.0);
            let found = highest_rate(bounds, device(capacity)).unwrap();
            assert!(found.rate_pps <= capacity, "{capacity}: {found:?}");
            assert!(found.rate_pps > capacity - 1_000.0, "{capacity}: {found:?}");
            assert!(found.trials.len() <= 12, "{}", found.trials.len());
        }
    }

    #[test]
    fn a_device_faster_than_the_tester_is_reported_at_what_the_tester_offered() {
        let bounds = bounds(1e9, 1e3, 0.0, 0.0);
        let tester = |_: f64| {
            Ok(Outcome {
                offered_pps: 2e6,
                loss_ratio: 0.0,
            })
        };
        let found = highest_rate(bounds, tester).unwrap();
        assert_eq!((found.rate_pps, found.tester_limited), (2e6, true));
    }

    #[test]
    fn a_partial_drop_rate_allows_its_share_of_loss() {
        let bounds = bounds(200_000.0, 100.0, 0.001, 0.0);
        // Loses 0.05 % at any rate, and everything above 100 000.
        let leaky = |rate: f64| {
            Ok(Outcome {
                offered_pps: rate,
                loss_ratio: if rate > 100_000.0 { 0.5 } else { 0.0005 },
            })
        };
        let found = highest_rate(bounds, leaky).unwrap();
        assert!(
            (99_900.0..=100_000.0).contains(&found.rate_pps),
            "{found:?}"
        );
        let strict = Bounds {
            loss_ratio: 0.00001,
            ..bounds
        };
        assert_eq!(highest_rate(strict, leaky).unwrap().rate_pps, 0.0);
    }

    #[test]
    fn a_rate_the_tester_could_not_offer_does_not_pass() {
        let bounds = bounds(100_000.0, 1_000.0, 0.0, 0.0);
        // Loses 1 % at full speed; offers at most 40 000/s and loses nothing at that pace.
        let tester = |rate: f64| {
            Ok(Outcome {
                offered_pps: rate.min(40_000.0),
                loss_ratio: if rate >= 100_000.0 { 0.01 } else { 0.0 },
            })
        };
        let found = highest_rate(bounds, tester).unwrap();
        assert!(found.rate_pps <= 40_000.0 / OFFERED_AT_LEAST, "{found:?}");
        assert!(found.tester_limited, "{found:?}");
    }

    #[test]
    fn a_search_from_a_rate_known_to_pass_looks_only_above_it() {
        let bounds = bounds(100_000.0, 1_000.0, 0.0, 60_000.0);
        let found = highest_rate(bounds, device(70_000.0)).unwrap();
        assert!(
            found.trials.iter().all(|(rate, _)| *rate > 60_000.0),
            "{found:?}"
        );
        assert!((69_000.0..=70_000.0).contains(&found.rate_pps), "{found:?}");
    }

    #[test]
    fn a_trial_the_tester_could_not_pace_is_run_again_not_held_against_the_device() {
        // Forwards up to 400 000/s. At the first rate it can forward, one trial loses 1 % to
        // a host stall and the next falls behind (the tester's core stalled: 5 % short).
        let tester = || {
            let (mut first, mut n) = (None, 0);
            move |rate: f64| {
                if rate <= 400_000.0 && first.is_none() {
                    first = Some(rate);
                }
                if first == Some(rate) {
                    n += 1;
                }
                let offered = if first == Some(rate) && n == 3 {
                    rate * 0.95
                } else {
                    rate
                };
                let stall = if first == Some(rate) && n == 2 {
                    0.01
                } else {
                    0.0
                };
                Ok(Outcome {
                    offered_pps: offered,
                    loss_ratio: ((offered - 400_000.0) / offered).max(stall),
                })
            }
        };
        let three = Bounds {
            trials_per_rate: 3,
            ..bounds(1_000_000.0, 1_000.0, 0.0, 0.0)
        };
        let found = highest_rate(three, tester()).unwrap();
        assert!(
            (399_000.0..=400_000.0).contains(&found.rate_pps),
            "{found:?}"
        );
        // A tester that never keeps up at a rate still fails it, after a majority of trials.
        let slow = |rate: f64| {
            Ok(Outcome {
                offered_pps: rate.min(40_000.0),
                loss_ratio: 0.0,
            })
        };
        let found = highest_rate(three, slow).unwrap();
        assert!(found.rate_pps <= 40_000.0 / OFFERED_AT_LEAST, "{found:?}");
        let at_top = found
            .trials
            .iter()
            .filter(|(r, _)| *r == 1_000_000.0)
            .count();
        assert_eq!(at_top, 2, "{found:?}");
    }

    #[test]
    fn the_majority_of_trials_decides_so_a_stall_in_one_does_not_halve_the_rate() {
        // Forwards up to 500 000/s; every third trial at any rate loses 1 % to a host stall.
        let stalling = || {
            let mut n = 0;
            move |rate: f64| {
                n += 1;
                let stall = if n % 3 == 2 { 0.01 } else { 0.0 };
                Ok(Outcome {
                    offered_pps: rate,
                    loss_ratio: ((rate - 500_000.0) / rate).max(0.0).max(stall),
                })
            }
        };
        let one = bounds(1_000_000.0, 1_000.0, 0.0, 0.0);
        let alone = highest_rate(one, stalling()).unwrap();
        let three = Bounds {
            trials_per_rate: 3,
            ..one
        };
        let voted = highest_rate(three, stalling()).unwrap();
        assert!(
            (499_000.0..=500_000.0).contains(&voted.rate_pps),
            "{voted:?}"
        );
        assert!(
            alone.rate_pps < 499_000.0,
            "one trial per rate was misled: {alone:?}"
        );
        // A steady device costs two trials per rate, not three.
        let steady = highest_rate(three, device(500_000.0)).unwrap();
        let rates = steady.trials.len() / 2;
        assert_eq!(steady.trials.len(), 2 * rates, "{steady:?}");
    }
}
