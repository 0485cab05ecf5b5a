//! The action set (§5.10): what `Write-Actions` instructions leave for the end of the walk.

use crate::action::Action;

/// The action set (§5.10): at most one action of each kind (one set-field per field), run
/// in the specification's order. Slots are ranks in that order.
#[derive(Clone, Copy)]
pub(super) struct ActionSet<'a> {
    slots: [Option<&'a Action>; SLOTS],
}

const SET_FIELD_SLOT: usize = 12;
const SLOTS: usize = SET_FIELD_SLOT + 40 + 3;

impl<'a> ActionSet<'a> {
    #[inline]
    pub(super) fn new() -> Self {
        ActionSet {
            slots: [None; SLOTS],
        }
    }

    #[inline]
    pub(super) fn slot(a: &Action) -> usize {
        match a {
            Action::CopyTtlIn => 0,
            Action::PopVlan => 1,
            Action::PopMpls(_) => 2,
            Action::PopPbb => 3,
            Action::PushMpls(_) => 4,
            Action::PushPbb(_) => 5,
            Action::PushVlan(_) => 6,
            Action::CopyTtlOut => 7,
            Action::DecMplsTtl => 8,
            Action::DecNwTtl => 9,
            Action::SetMplsTtl(_) => 10,
            Action::SetNwTtl(_) => 11,
            Action::SetField { id, .. } => SET_FIELD_SLOT + (*id as usize).min(39),
            Action::SetQueue(_) => SET_FIELD_SLOT + 40,
            Action::Group(_) => SET_FIELD_SLOT + 41,
            Action::Output { .. } => SET_FIELD_SLOT + 42,
        }
    }

    #[inline]
    pub(super) fn write(&mut self, actions: &'a [Action]) {
        for a in actions {
            self.slots[Self::slot(a)] = Some(a);
        }
    }

    /// The set's actions in the order they run; a group takes the place of the output.
    #[inline]
    pub(super) fn ordered(&self) -> impl Iterator<Item = &'a Action> + '_ {
        let has_group = self.slots[SET_FIELD_SLOT + 41].is_some();
        self.slots
            .iter()
            .enumerate()
            .filter(move |(i, _)| !(has_group && *i == SET_FIELD_SLOT + 42))
            .filter_map(|(_, a)| *a)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn set_field(id: u8, v: u8) -> Action {
        Action::SetField { id, value: vec![v] }
    }

    fn ordered(writes: &[Vec<Action>]) -> Vec<Action> {
        let mut set = ActionSet::new();
        for w in writes {
            set.write(w);
        }
        set.ordered().cloned().collect()
    }

    #[test]
    fn the_set_runs_in_the_specifications_order_whatever_the_order_written() {
        let got = ordered(&[vec![
            Action::Output {
                port: 1,
                max_len: 0,
            },
            set_field(3, 1),
            Action::DecNwTtl,
            Action::PushVlan(stitch_wire::ethertype::VLAN),
            Action::PopVlan,
            Action::CopyTtlIn,
            Action::SetQueue(0),
        ]]);
        assert_eq!(
            got,
            [
                Action::CopyTtlIn,
                Action::PopVlan,
                Action::PushVlan(stitch_wire::ethertype::VLAN),
                Action::DecNwTtl,
                set_field(3, 1),
                Action::SetQueue(0),
                Action::Output {
                    port: 1,
                    max_len: 0
                },
            ]
        );
    }

    #[test]
    fn a_later_write_replaces_the_action_of_its_kind_and_set_fields_are_per_field() {
        let got = ordered(&[
            vec![
                set_field(3, 1),
                set_field(5, 1),
                Action::Output {
                    port: 1,
                    max_len: 0,
                },
            ],
            vec![
                set_field(3, 2),
                Action::Output {
                    port: 2,
                    max_len: 0,
                },
            ],
        ]);
        assert_eq!(
            got,
            [
                set_field(3, 2),
                set_field(5, 1),
                Action::Output {
                    port: 2,
                    max_len: 0
                }
            ]
        );
    }

    #[test]
    fn a_group_takes_the_place_of_the_output() {
        let got = ordered(&[vec![
            Action::Output {
                port: 1,
                max_len: 0,
            },
            Action::Group(7),
        ]]);
        assert_eq!(got, [Action::Group(7)]);
    }
}
