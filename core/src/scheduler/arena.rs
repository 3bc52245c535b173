//! A generational arena: dense storage with stable `u32` keys. A key whose slot was freed and
//! reused no longer resolves, which is how late results and stale timers are recognised.

/// Key of an arena entry.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub(crate) struct Key {
    pub(crate) index: u32,
    pub(crate) generation: u32,
}

struct Slot<T> {
    generation: u32,
    value: Option<T>,
}

/// Slots per chunk. Chunks are allocated whole and never move, so growth costs at most one
/// partly used chunk instead of a doubled vector (up to 2x the live size) and a copy of everything.
const CHUNK: usize = 1024;

/// Dense storage with generational keys.
pub(crate) struct Arena<T> {
    chunks: Vec<Vec<Slot<T>>>,
    free: Vec<u32>,
    len: usize,
    /// Slots ever created (live or free).
    slots: usize,
}

impl<T> Default for Arena<T> {
    fn default() -> Self {
        Arena {
            chunks: Vec::new(),
            free: Vec::new(),
            len: 0,
            slots: 0,
        }
    }
}

impl<T> Arena<T> {
    fn slot(&self, index: u32) -> Option<&Slot<T>> {
        let i = index as usize;
        self.chunks.get(i / CHUNK)?.get(i % CHUNK)
    }

    fn slot_mut(&mut self, index: u32) -> Option<&mut Slot<T>> {
        let i = index as usize;
        self.chunks.get_mut(i / CHUNK)?.get_mut(i % CHUNK)
    }

    /// Stores a value.
    pub(crate) fn insert(&mut self, value: T) -> Key {
        self.len += 1;
        if let Some(index) = self.free.pop() {
            let slot = self.slot_mut(index).expect("free slots exist");
            slot.value = Some(value);
            return Key {
                index,
                generation: slot.generation,
            };
        }
        let index = u32::try_from(self.slots).expect("fewer than 2^32 entries");
        if self.slots.is_multiple_of(CHUNK) {
            self.chunks.push(Vec::with_capacity(CHUNK));
        }
        let chunk = self.chunks.last_mut().expect("a chunk with room");
        chunk.push(Slot {
            generation: 0,
            value: Some(value),
        });
        self.slots += 1;
        Key {
            index,
            generation: 0,
        }
    }

    /// Removes a value; its key stops resolving.
    pub(crate) fn remove(&mut self, key: Key) -> Option<T> {
        let slot = self.slot_mut(key.index)?;
        if slot.generation != key.generation {
            return None;
        }
        let value = slot.value.take()?;
        slot.generation = slot.generation.wrapping_add(1);
        self.free.push(key.index);
        self.len -= 1;
        Some(value)
    }

    /// The value under `key`, if it is still there.
    pub(crate) fn get(&self, key: Key) -> Option<&T> {
        let slot = self.slot(key.index)?;
        if slot.generation != key.generation {
            return None;
        }
        slot.value.as_ref()
    }

    /// Mutable access.
    pub(crate) fn get_mut(&mut self, key: Key) -> Option<&mut T> {
        let slot = self.slot_mut(key.index)?;
        if slot.generation != key.generation {
            return None;
        }
        slot.value.as_mut()
    }

    /// Number of live entries.
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Live entries in index order.
    pub(crate) fn iter(&self) -> impl Iterator<Item = (Key, &T)> {
        self.chunks
            .iter()
            .flatten()
            .enumerate()
            .filter_map(|(i, s)| {
                s.value.as_ref().map(|v| {
                    (
                        Key {
                            index: i as u32,
                            generation: s.generation,
                        },
                        v,
                    )
                })
            })
    }

    /// Bytes held by the slots (for memory accounting).
    pub(crate) fn capacity_bytes(&self) -> usize {
        self.chunks.len() * CHUNK * std::mem::size_of::<Slot<T>>()
            + self.chunks.capacity() * std::mem::size_of::<Vec<Slot<T>>>()
            + self.free.capacity() * std::mem::size_of::<u32>()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stale_keys_do_not_resolve_after_reuse() {
        let mut a = Arena::default();
        let k1 = a.insert("a");
        assert_eq!(a.remove(k1), Some("a"));
        let k2 = a.insert("b");
        assert_eq!(k1.index, k2.index);
        assert_eq!(a.get(k1), None);
        assert_eq!(a.get(k2), Some(&"b"));
        assert_eq!(a.remove(k1), None);
        assert_eq!(a.len(), 1);
    }

    #[test]
    fn keys_stay_valid_across_chunks() {
        let mut a = Arena::default();
        let keys: Vec<Key> = (0..3 * CHUNK + 5).map(|i| a.insert(i)).collect();
        for (i, k) in keys.iter().enumerate() {
            assert_eq!(a.get(*k), Some(&i));
        }
        assert_eq!(a.remove(keys[CHUNK]), Some(CHUNK));
        let reused = a.insert(7);
        assert_eq!(reused.index as usize, CHUNK);
        assert_eq!(a.get(keys[CHUNK]), None);
        assert_eq!(a.iter().count(), 3 * CHUNK + 5);
        assert_eq!(a.iter().nth(CHUNK).map(|(k, v)| (k, *v)), Some((reused, 7)));
        assert_eq!(a.len(), 3 * CHUNK + 5);
    }
}
