//! What a remembered walk did to the frame, kept as its net effect: for each output, the port
//! and the frame's new first bytes. Open vSwitch's translation does the same (a tag pushed,
//! set and popped again leaves no datapath action at all): a packet of a known flow then
//! leaves with one small copy instead of running each entry's instructions.
//!
//! The net effect is the same for every frame that takes the same walk (the walk cache's key
//! bits), enters by the same port and starts with the same bytes as the frame it was seen on —
//! as long as every action on the way reads and writes only those first bytes. [`Probe`]
//! watches a walk as it runs and keeps its net effect only then: VLAN push and pop, set-field
//! of the Ethernet addresses and of the VLAN id and priority, outputs to a port. A meter, a
//! group, the controller, a flood, a TTL or any other field makes the walk one to replay.

use crate::action::Action;
use crate::oxm;
use stitch_core::Packet;

/// Most bytes of the input a net effect may depend on.
const MAX_SEEN: usize = 32;
/// Most bytes an output's new head may have.
const MAX_HEAD: usize = 48;
/// The bytes a qualifying action reads or writes: the addresses, and the ethertype that says
/// whether there is a tag …
const REACH_UNTAGGED: usize = 14;
/// … and the outer tag's TCI when there is.
const REACH_TAGGED: usize = 16;
/// A frame shorter than this is padded by a pop: its net effect would depend on its length.
const MIN_FRAME: usize = 60;
/// Most outputs a net effect has (a walk that copies the frame to more ports is replayed).
const MAX_OUTPUTS: usize = 8;

/// One output of a net effect: the frame's first `cut` bytes become `head`, then it goes to
/// `port`.
#[derive(Clone, Copy)]
pub struct Output {
    pub port: u32,
    cut: u8,
    len: u8,
    head: [u8; MAX_HEAD],
}

impl Output {
    /// Makes `p` what the walk sent to this output; `false` when the buffer has no room.
    #[inline]
    pub fn apply(&self, p: &mut Packet) -> bool {
        if self.cut == 0 && self.len == 0 {
            return true;
        }
        stitch_wire::vlan::replace_head(p, self.cut as usize, &self.head[..self.len as usize])
            .is_ok()
    }
}

/// The net effect of a walk, and what a frame must have for it to hold.
#[derive(Clone, Copy)]
pub struct Net {
    in_port: u32,
    /// The input's first bytes, zero past `seen_len`, and the mask of those that count.
    seen: [u128; 2],
    seen_mask: [u128; 2],
    /// How much shorter than the input the frame was at its shortest.
    shrink: u16,
    /// Where the outputs are in the cache's list of them, and how many.
    pub outputs_at: u32,
    pub outputs: u8,
}

impl Net {
    /// Whether the net effect holds for frame `p` entering by `in_port`.
    #[inline]
    pub fn holds(&self, p: &Packet, in_port: u32) -> bool {
        let d = p.data();
        if in_port != self.in_port || d.len() < MIN_FRAME + self.shrink as usize {
            return false;
        }
        // MIN_FRAME > MAX_SEEN: both words are in the frame.
        let word = |i: usize| u128::from_ne_bytes(d[i * 16..i * 16 + 16].try_into().unwrap());
        ((word(0) ^ self.seen[0]) & self.seen_mask[0])
            | ((word(1) ^ self.seen[1]) & self.seen_mask[1])
            == 0
    }
}

/// Watches a walk being looked up (the cache's miss path) and works out its net effect.
#[derive(Default)]
pub struct Probe {
    watching: bool,
    pure: bool,
    input: Vec<u8>,
    in_port: u32,
    /// The first `front` bytes of the frame now come from the input's first `used` bytes (and
    /// from the actions); from there on it is the input's bytes from `used` on.
    front: usize,
    used: usize,
    shortest: usize,
    outputs: Vec<Output>,
}

impl Probe {
    /// Starts watching the walk of `frame`, entering by `in_port`.
    pub fn start(&mut self, frame: &[u8], in_port: u32) {
        self.watching = true;
        self.pure = frame.len() >= MIN_FRAME;
        self.input.clear();
        self.input.extend_from_slice(frame);
        self.in_port = in_port;
        self.front = 0;
        self.used = 0;
        self.shortest = frame.len();
        self.outputs.clear();
    }

    /// Whether a walk is being watched and still has a net effect.
    #[inline]
    pub fn watching(&self) -> bool {
        self.watching && self.pure
    }

    /// The walk does something a net effect cannot hold (nothing, when no walk is watched: the
    /// next [`Probe::start`] begins afresh).
    pub fn spoil(&mut self) {
        self.pure = false;
    }

    /// Before rewrite `a` runs on `frame`: the length change it will make, if it qualifies.
    pub fn before(&mut self, a: &Action, frame: &[u8]) -> Option<isize> {
        let tagged = stitch_wire::vlan::outer_tag(frame).is_some();
        let tag_reach = if tagged { REACH_TAGGED } else { REACH_UNTAGGED };
        let (change, reach) = match a {
            Action::PushVlan(_) => (4, tag_reach),
            Action::PopVlan => (if tagged { -4 } else { 0 }, tag_reach),
            Action::SetField { id, .. } => match *id {
                oxm::ETH_DST | oxm::ETH_SRC => (0, 12),
                oxm::VLAN_VID | oxm::VLAN_PCP => (0, tag_reach),
                _ => {
                    self.pure = false;
                    return None;
                }
            },
            _ => {
                self.pure = false;
                return None;
            }
        };
        if self.front < reach {
            self.used += reach - self.front;
            self.front = reach;
        }
        if self.used > MAX_SEEN || (frame.len() as isize + change) < MIN_FRAME as isize {
            self.pure = false;
            return None;
        }
        Some(change)
    }

    /// After the rewrite: the frame went from `before` to `after` bytes, `change` expected.
    pub fn after(&mut self, change: isize, before: usize, after: usize) {
        if after as isize != before as isize + change {
            self.pure = false;
            return;
        }
        self.front = (self.front as isize + change) as usize;
        self.shortest = self.shortest.min(after);
    }

    /// `frame` goes out by `port`.
    pub fn output(&mut self, port: u32, frame: &[u8]) {
        let rest = &self.input[self.used..];
        let Some(len) = frame.len().checked_sub(rest.len()) else {
            self.pure = false;
            return;
        };
        if len > MAX_HEAD || &frame[len..] != rest {
            self.pure = false;
            return;
        }
        // A head that came back as it was (a tag pushed and popped again) is no edit at all.
        let cut = if frame[..len] == self.input[..self.used] {
            0
        } else {
            self.used
        };
        let len = if cut == 0 { 0 } else { len };
        let mut head = [0; MAX_HEAD];
        head[..len].copy_from_slice(&frame[..len]);
        self.outputs.push(Output {
            port,
            cut: cut as u8,
            len: len as u8,
            head,
        });
    }

    /// Stops watching; the net effect and its outputs, when the walk has one.
    pub fn finish(&mut self) -> Option<(Net, &[Output])> {
        let watched = std::mem::take(&mut self.watching);
        if !watched || !self.pure || self.outputs.len() > MAX_OUTPUTS {
            return None;
        }
        let (mut seen, mut mask) = ([0u8; 32], [0u8; 32]);
        seen[..self.used].copy_from_slice(&self.input[..self.used]);
        mask[..self.used].fill(0xff);
        let words = |b: [u8; 32]| {
            [
                u128::from_ne_bytes(b[..16].try_into().unwrap()),
                u128::from_ne_bytes(b[16..].try_into().unwrap()),
            ]
        };
        let net = Net {
            in_port: self.in_port,
            seen: words(seen),
            seen_mask: words(mask),
            shrink: (self.input.len() - self.shortest) as u16,
            outputs_at: 0,
            outputs: self.outputs.len() as u8,
        };
        Some((net, &self.outputs[..net.outputs as usize]))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use stitch_core::pool;
    use stitch_wire::be::{self, Put};
    use stitch_wire::ethertype;

    fn packet(frame: &[u8]) -> Packet {
        let _ = pool::init(1024, 0);
        let mut p = pool::alloc().unwrap();
        p.set_data(frame).unwrap();
        p
    }

    /// An untagged (or, with `tag`, tagged) frame of `len` bytes whose payload counts up.
    fn frame(len: usize, tag: Option<u16>) -> Vec<u8> {
        let mut f: Vec<u8> = vec![0x0e, 0, 0, 0, 0, 2, 0x0e, 0, 0, 0, 0, 1];
        if let Some(t) = tag {
            f.extend_from_slice(&ethertype::VLAN.to_be_bytes());
            f.put(t);
        }
        f.extend_from_slice(&ethertype::IPV4.to_be_bytes());
        while f.len() < len {
            f.push(f.len() as u8);
        }
        f
    }

    /// Runs `actions` on `frame` under a probe, outputting to port 2 at the end.
    fn watch(frame: &[u8], actions: &[Action]) -> (Probe, Vec<u8>) {
        let mut probe = Probe::default();
        let mut p = packet(frame);
        let mut key = crate::oxm::Key::extract(p.data(), 1);
        probe.start(p.data(), 1);
        for a in actions {
            let before = p.len();
            let change = probe.before(a, p.data());
            crate::action::rewrite(&mut p, &mut key, a);
            if let Some(change) = change {
                probe.after(change, before, p.len());
            }
        }
        probe.output(2, p.data());
        (probe, p.data().to_vec())
    }

    fn set(id: u8, value: &[u8]) -> Action {
        Action::SetField {
            id,
            value: value.to_vec(),
        }
    }

    #[test]
    fn a_net_effect_makes_what_the_actions_made_for_every_frame_it_holds_for() {
        let actions = [
            Action::PushVlan(ethertype::VLAN),
            set(oxm::VLAN_VID, &be::net(0x1064u16)),
            set(oxm::ETH_SRC, &[0x0e, 0, 0, 0, 0, 9]),
        ];
        let (mut probe, sent) = watch(&frame(100, None), &actions);
        let (net, outputs) = probe
            .finish()
            .expect("tag and address edits have a net effect");
        let (net, outputs) = (net, outputs.to_vec());
        // Another frame of the flow: same first bytes, other payload and length.
        let other = frame(80, None);
        let mut p = packet(&other);
        assert!(net.holds(&p, 1));
        assert!(outputs[0].apply(&mut p));
        let (_, expected) = watch(&other, &actions);
        assert_eq!(p.data(), &expected[..]);
        assert_eq!(sent.len(), 104);
        // Not for another port, other first bytes, or a frame too short to have them.
        assert!(!net.holds(&packet(&other), 3));
        let mut dst = other.clone();
        dst[0] = 0x0f;
        assert!(!net.holds(&packet(&dst), 1));
        assert!(!net.holds(&packet(&frame(40, None)), 1));
    }

    #[test]
    fn a_tag_pushed_and_popped_again_is_no_edit() {
        let (mut probe, _) = watch(
            &frame(60, None),
            &[Action::PushVlan(ethertype::VLAN), Action::PopVlan],
        );
        let (_, outputs) = probe.finish().unwrap();
        assert_eq!((outputs[0].cut, outputs[0].len), (0, 0));
    }

    #[test]
    fn walks_whose_effect_depends_on_more_than_the_first_bytes_have_none() {
        // A TTL is past the addresses and the tag, and changes the checksum.
        let (mut probe, _) = watch(&frame(60, None), &[Action::DecNwTtl]);
        assert!(probe.finish().is_none());
        // A pop that leaves a runt is padded: the result depends on the frame's length.
        let (mut probe, _) = watch(&frame(62, Some(100)), &[Action::PopVlan]);
        assert!(probe.finish().is_none());
        let (mut probe, _) = watch(&frame(64, Some(100)), &[Action::PopVlan]);
        assert!(probe.finish().is_some());
    }
}
