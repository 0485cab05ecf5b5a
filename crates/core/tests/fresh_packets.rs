//! `Producer::transmit_fresh` on a pool of its own (this test binary is its own process): the
//! pool's exhaustion is counted exactly, and a writer that panics gives every buffer back.

use std::panic::{catch_unwind, AssertUnwindSafe};
use stitch_core::link::link;
use stitch_core::pool;

#[test]
fn fresh_packets_count_exhaustion_and_survive_a_panicking_writer() {
    let p = pool::init(512, 1).unwrap();
    let total = p.packets();
    let (mut tx, mut rx) = link(2048);

    let sent = tx.transmit_fresh(total + 40, 60, |q| q.set_data(&[1; 60]).unwrap());
    assert_eq!(sent, total);
    assert_eq!(
        p.stats().exhausted,
        40,
        "each packet missing is one failure"
    );
    assert_eq!(p.stats().in_use, total);
    assert_eq!(tx.ring().stats().tx_packets, total as u64);
    assert_eq!(rx.free_available(), (total as u64, 60 * total as u64));
    assert_eq!(p.stats().in_use, 0);

    // The writer panics at its third packet: nothing is queued and nothing is lost. (The
    // engine catches a panicking app and carries on, so this must hold.)
    let mut n = 0;
    let unwound = catch_unwind(AssertUnwindSafe(|| {
        tx.transmit_fresh(100, 64, |q| {
            n += 1;
            assert!(n < 3, "writer gives up");
            q.set_data(&[2; 60]).unwrap();
        })
    }));
    assert!(unwound.is_err());
    assert_eq!(rx.available(), 0);
    assert_eq!(p.stats().in_use, 0);
    assert_eq!(tx.ring().stats().tx_packets, total as u64);

    // The link and the pool carry on as before.
    assert_eq!(
        tx.transmit_fresh(100, 64, |q| q.set_data(&[3; 64]).unwrap()),
        100
    );
    assert!(rx.drain().all(|q| q.data() == [3; 64]));
    assert_eq!(p.stats().exhausted, 40);
}
