//! Per-port policy, as snabbnfv configured each VM port: the guest's MAC address (frames from
//! the guest with another source are spoofed; unicast frames to the guest for another address
//! are not for it), a libpcap filter and a rate limit in each direction. `ingress` is toward
//! the guest, `egress` from it.

use std::time::Instant;
use stitch_apps::generator::RateSpec;
use stitch_apps::policer::{rate_of, TokenBucket};
use stitch_core::{AppContext, Counter, Packet};
use stitch_wire::filter::PacketFilter;

pub struct Direction {
    filter: Option<PacketFilter>,
    bucket: Option<TokenBucket>,
    filtered: Counter,
    policed: Counter,
    mac_drops: Counter,
}

impl Direction {
    pub fn new(
        ctx: &AppContext,
        name: &str,
        filter: Option<&str>,
        rate: Option<&RateSpec>,
    ) -> Result<Direction, String> {
        let filter = match filter {
            Some(expr) => Some(PacketFilter::compile(expr)?),
            None => None,
        };
        let bucket = match rate {
            Some(r) => Some(TokenBucket::new(rate_of(r)?, None)?),
            None => None,
        };
        Ok(Direction {
            filter,
            bucket,
            filtered: ctx.counter(&format!("{name}_filtered_drops")),
            policed: ctx.counter(&format!("{name}_policed_drops")),
            mac_drops: ctx.counter(&format!("{name}_mac_drops")),
        })
    }

    pub fn is_open(&self) -> bool {
        self.filter.is_none() && self.bucket.is_none()
    }

    /// Once per batch; reads the clock only when there is a rate limit.
    pub fn refill(&mut self) {
        if let Some(b) = &mut self.bucket {
            b.refill(Instant::now());
        }
    }

    /// Whether `p` may pass; counts why not.
    pub fn admit(&mut self, p: &Packet, mac: Option<[u8; 6]>, source: bool) -> bool {
        if let (Some(mac), Some(d)) = (mac, p.data().get(..12)) {
            let addr = if source { &d[6..12] } else { &d[0..6] };
            let group = addr[0] & 1 != 0;
            if addr != mac && (source || !group) {
                self.mac_drops.add(1);
                return false;
            }
        }
        if let Some(f) = &self.filter {
            if !f.matches(p.data()) {
                self.filtered.add(1);
                return false;
            }
        }
        if let Some(b) = &mut self.bucket {
            if !b.take(p.len()) {
                self.policed.add(1);
                return false;
            }
        }
        true
    }
}
