//! The pool's batch calls on a pool of its own (this test binary is its own process): exact
//! exhaustion counts, and nothing lost when packets are dropped while a batch is being freed.

use stitch_core::pool;

#[test]
fn batches_count_exhaustion_exactly_and_lose_nothing() {
    let p = pool::init(512, 1).unwrap();
    let total = p.packets();
    let mut held = Vec::new();
    assert_eq!(pool::alloc_batch(total + 88, &mut held), total);
    assert_eq!(held.len(), total);
    let s = p.stats();
    assert_eq!(
        s.exhausted, 88,
        "every packet asked for and missing is one failure"
    );
    assert_eq!(s.in_use, total);
    assert!(pool::alloc().is_none());
    assert_eq!(p.stats().exhausted, 89);

    // Every fresh packet is empty with its headroom, whatever its buffer held before.
    for q in held.iter_mut() {
        q.set_data(&[0xee; 60]).unwrap();
    }
    pool::free_batch(held.drain(..100));
    assert_eq!(pool::alloc_batch(100, &mut held), 100);
    assert!(held[total - 100..]
        .iter()
        .all(|q| q.len() == 0 && q.headroom() == stitch_core::packet::HEADROOM));

    // The iterator itself drops every other packet while free_batch holds the thread's cache:
    // those go the uncached way and all come back.
    let mut i = 0;
    pool::free_batch(held.drain(..).filter(|_| {
        i += 1;
        i % 2 == 0
    }));
    assert_eq!(p.stats().in_use, 0);
    assert_eq!(pool::alloc_batch(total, &mut held), total);
    assert_eq!(p.stats().exhausted, 89);
}
