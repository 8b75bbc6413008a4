//! Which node should own a partition: rendezvous (highest random weight) hashing, so every node
//! computes the same ranking from the same member list without talking, a new node takes about
//! 1/N of the partitions, and a leaving node's partitions spread over all the others.

/// A stable 64-bit weight of (node, topic, partition): FNV-1a then the splitmix64 finaliser,
/// fixed here so that every version of every node agrees.
fn weight(node: i32, topic: &str, partition: u32) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let mut eat = |bytes: &[u8]| {
        for &b in bytes {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
    };
    eat(&node.to_be_bytes());
    eat(topic.as_bytes());
    eat(&[0]);
    eat(&partition.to_be_bytes());
    h ^= h >> 30;
    h = h.wrapping_mul(0xbf58_476d_1ce4_e5b9);
    h ^= h >> 27;
    h = h.wrapping_mul(0x94d0_49bb_1331_11eb);
    h ^ (h >> 31)
}

/// Where `node` stands among `nodes` for the partition: 0 is the preferred owner. `None` when
/// `node` is not among them.
pub(crate) fn rank(nodes: &[i32], node: i32, topic: &str, partition: u32) -> Option<usize> {
    let mine = (weight(node, topic, partition), node);
    nodes.contains(&node).then(|| {
        nodes
            .iter()
            .filter(|&&n| (weight(n, topic, partition), n) > mine)
            .count()
    })
}

/// The node that ranks first among `nodes` for `key` in `slot`: every node names the same one
/// from the same member list (the coordinator of a consumer group, for example).
pub(crate) fn first(nodes: &[i32], key: &str, slot: u32) -> Option<i32> {
    nodes
        .iter()
        .copied()
        .max_by_key(|&n| (weight(n, key, slot), n))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn preferred(nodes: &[i32], topic: &str, partition: u32) -> i32 {
        *nodes
            .iter()
            .find(|&&n| rank(nodes, n, topic, partition) == Some(0))
            .expect("one node ranks first")
    }

    #[test]
    fn first_is_the_node_at_rank_zero() {
        let nodes = [4, 1, 9];
        for slot in 0..100 {
            let key = format!("group-{slot}");
            assert_eq!(
                first(&nodes, &key, u32::MAX),
                Some(preferred(&nodes, &key, u32::MAX))
            );
        }
        assert_eq!(first(&[], "g", 0), None);
    }

    #[test]
    fn every_partition_has_exactly_one_node_at_each_rank() {
        let nodes = [1, 2, 3, 7];
        for p in 0..200 {
            let mut ranks: Vec<usize> = nodes
                .iter()
                .map(|&n| rank(&nodes, n, "t", p).unwrap())
                .collect();
            ranks.sort_unstable();
            assert_eq!(ranks, vec![0, 1, 2, 3]);
        }
        assert_eq!(rank(&nodes, 9, "t", 0), None);
    }

    #[test]
    fn partitions_spread_and_a_leaving_node_only_moves_its_own() {
        let three = [1, 2, 3];
        let mut counts = [0usize; 3];
        for p in 0..3000 {
            counts[(preferred(&three, "camera-images", p) - 1) as usize] += 1;
        }
        for c in counts {
            assert!((800..1200).contains(&c), "uneven spread {counts:?}");
        }
        let two = [1, 3];
        for p in 0..3000 {
            let before = preferred(&three, "camera-images", p);
            if before != 2 {
                assert_eq!(preferred(&two, "camera-images", p), before);
            }
        }
    }
}
