//! Encoding, placement, header and whole-batch validation, and decoding of RecordBatch v2.

use bytes::{BufMut, BytesMut};
use proptest::prelude::*;

use super::encoder::{BLOCK, Memory, put_headers, put_record_head, record_body_len, seal};
use super::*;
use crate::mapped::HUGE_PAGE;

fn rec(ts: i64, key: Option<&[u8]>, value: &[u8]) -> Record {
    Record {
        timestamp: ts,
        key: key.map(Bytes::copy_from_slice),
        value: Some(Bytes::copy_from_slice(value)),
        headers: vec![("h".into(), Bytes::from_static(b"v"))],
    }
}

#[test]
fn encoded_batch_validates_and_decodes() {
    let records = vec![rec(1000, Some(b"k"), b"hello"), rec(990, None, b"")];
    let mut buf = encode(&records, ProducerInfo::NONE);
    let h = validate(&buf).unwrap();
    assert_eq!(h.record_count, 2);
    assert_eq!(h.max_timestamp, 1000);
    set_base_offset(&mut buf, 42);
    let h = validate(&buf).unwrap();
    assert_eq!(h.base_offset, 42);
    assert_eq!(h.last_offset(), 43);
    let decoded = decode_records(&buf.freeze()).unwrap();
    assert_eq!(decoded[0].offset, 42);
    assert_eq!(decoded[1].offset, 43);
    assert_eq!(decoded[0].record, records[0]);
    assert_eq!(decoded[1].record, records[1]);
}

/// A topic's `compression.type`: a batch is rewritten in the topic's codec with the same
/// records, offsets, timestamps and producer fields, validates whole, and comes back to the
/// same bytes when written uncompressed again.
#[test]
fn a_batch_recompresses_to_every_codec_and_back() {
    let records: Vec<Record> = (0..200)
        .map(|i| {
            let reading = format!("{{\"device\":\"d{}\",\"temp\":{}.5}}", i % 7, i % 30);
            rec(1_000 + i, Some(b"sensor"), reading.as_bytes())
        })
        .collect();
    let producer = ProducerInfo {
        producer_id: 7,
        producer_epoch: 1,
        base_sequence: 40,
    };
    let plain = encode(&records, producer);
    let plain_bytes = plain.clone().freeze();
    for codec in [
        Compression::Gzip,
        Compression::Snappy,
        Compression::Lz4,
        Compression::Zstd,
    ] {
        let batch = crate::ValidatedBatch::new(plain.clone())
            .unwrap()
            .recompressed(codec)
            .unwrap();
        assert_eq!(batch.header().compression(), codec);
        assert!(
            batch.len() * 3 < plain.len(),
            "{codec:?}: {} bytes",
            batch.len()
        );
        let bytes = batch.into_bytes();
        let (h, _) = validate_whole(&bytes).unwrap();
        let before = BatchHeader::parse(&plain).unwrap();
        assert_eq!(
            (
                h.record_count,
                h.max_timestamp,
                h.producer_id,
                h.base_sequence
            ),
            (before.record_count, before.max_timestamp, 7, 40)
        );
        let decoded = decode_records(&bytes).unwrap();
        assert_eq!(decoded.len(), 200);
        assert!(decoded.iter().zip(&records).all(|(d, r)| d.record == *r));
        let again = crate::ValidatedBatch::new(BytesMut::from(&bytes[..]))
            .unwrap()
            .recompressed(Compression::None)
            .unwrap();
        assert_eq!(again.into_bytes(), plain_bytes, "{codec:?} back to none");
    }
}

#[test]
fn split_batches_cuts_at_batch_boundaries() {
    let a = encode(&[rec(1, None, b"one")], ProducerInfo::NONE);
    let b = encode(
        &[rec(2, None, b"two"), rec(3, None, b"three")],
        ProducerInfo::NONE,
    );
    let mut both = a.clone();
    both.extend_from_slice(&b);
    let parts = split_batches(both.clone().freeze()).unwrap();
    assert_eq!(parts, vec![a.freeze(), b.freeze()]);
    both.truncate(both.len() - 1);
    assert!(matches!(
        split_batches(both.freeze()),
        Err(BatchError::LengthMismatch { .. })
    ));
}

#[test]
fn large_batches_are_placed_for_their_file_position() {
    let image = vec![7u8; 300_000];
    let records = [rec(5, Some(b"cam"), &image)];
    let plain = encode(&records, ProducerInfo::NONE);
    for position in [0u64, 1, 4095, 4096, 123_457, 268_435_455] {
        let placed = encode_at(&records, ProducerInfo::NONE, |_| Some(position));
        assert!(!placed.is_mapped(), "under a huge page");
        assert_eq!(&placed[..], &plain[..], "the same bytes, wherever they sit");
        assert_eq!(
            (placed.as_ptr() as u64).wrapping_sub(position) % BLOCK as u64,
            0,
            "position {position}"
        );
        // Placing survives the conversion that hands the batch to the live ring.
        let at = placed.as_ptr();
        assert_eq!(placed.freeze().as_ptr(), at);
    }
    // Small batches are not worth a block of spare capacity.
    let small = encode_at(&[rec(1, None, b"x")], ProducerInfo::NONE, |_| Some(1));
    let Memory::Heap(small) = small.0 else {
        panic!("a small batch is on the heap");
    };
    assert!(small.capacity() < BLOCK);
    // A batch of a huge page or more is built on huge pages, placed the same way.
    let image = vec![9u8; HUGE_PAGE + 1000];
    let records = [rec(5, Some(b"cam"), &image), rec(6, None, b"tail")];
    let plain = encode(&records, ProducerInfo::NONE);
    for position in [None, Some(0u64), Some(4095), Some(123_457)] {
        let huge = encode_at(&records, ProducerInfo::NONE, |_| position);
        assert_eq!(huge.is_mapped(), position.is_some());
        assert_eq!(&huge[..], &plain[..]);
        if let Some(position) = position {
            assert_eq!(
                (huge.as_ptr() as u64).wrapping_sub(position) % BLOCK as u64,
                0
            );
        }
    }
}

#[test]
fn a_value_read_into_an_open_batch_makes_the_encoded_batch() {
    // A batch under a huge page is built on the heap; one over it, once placed, in a
    // mapping of its own.
    for (size, placed_mapped) in [(300_000u32, false), (HUGE_PAGE as u32 + 70_000, true)] {
        let image: Vec<u8> = (0..size).map(|i| (i % 251) as u8).collect();
        let headers = vec![
            ("mqtt.qos".to_owned(), Bytes::from_static(b"1")),
            ("client".to_owned(), Bytes::from_static(b"cam-7")),
        ];
        let record = Record {
            timestamp: 1_700_000_000_123,
            key: Some(Bytes::from_static(b"cams/7")),
            value: Some(Bytes::copy_from_slice(&image)),
            headers: headers.clone(),
        };
        let want = encode(std::slice::from_ref(&record), ProducerInfo::NONE);
        for position in [None, Some(0u64), Some(4095), Some(123_457)] {
            let layout = OneRecord::new(Some(b"cams/7"), image.len(), &headers);
            assert_eq!(layout.len(), want.len());
            let mut open = layout.open(position);
            assert_eq!(open.buf.is_mapped(), placed_mapped && position.is_some());
            let at = open.buf.as_ptr();
            // Some bytes arrive with the packet's head, the rest in reads of any size.
            open.put_value(&image[..1000]);
            let mut rest = &image[1000..];
            while !rest.is_empty() {
                let mut room = open.value_buf();
                let n = room.remaining_mut().min(rest.len()).min(65_536);
                room.put_slice(&rest[..n]);
                rest = &rest[n..];
            }
            assert_eq!(open.value_missing(), 0);
            assert_eq!(
                open.value_buf().remaining_mut(),
                0,
                "nothing past the value"
            );
            let got = open.finish(record.timestamp);
            assert_eq!(&got[..], &want[..], "{size} B at {position:?}");
            assert_eq!(got.as_ptr(), at, "filled where it was laid out");
            if let Some(position) = position {
                assert_eq!((at as u64).wrapping_sub(position) % BLOCK as u64, 0);
            }
            let frozen = got.freeze();
            assert_eq!(frozen.as_ptr(), at, "frozen in place");
            assert_eq!(frozen, want);
        }
    }
}

#[test]
fn corrupt_payload_fails_crc() {
    let mut buf = encode(&[rec(1, None, b"payload")], ProducerInfo::NONE);
    let last = buf.len() - 3;
    buf[last] ^= 0xff;
    assert!(matches!(
        validate(&buf),
        Err(BatchError::CrcMismatch { .. })
    ));
}

#[test]
fn truncated_and_wrong_magic_are_rejected() {
    let buf = encode(&[rec(1, None, b"payload")], ProducerInfo::NONE);
    assert!(matches!(
        validate(&buf[..buf.len() - 1]),
        Err(BatchError::LengthMismatch { .. })
    ));
    assert!(matches!(
        validate(&buf[..10]),
        Err(BatchError::TooShort { len: 10 })
    ));
    let mut bad = buf.clone();
    bad[16] = 1;
    assert!(matches!(
        validate(&bad),
        Err(BatchError::UnsupportedMagic { magic: 1 })
    ));
}

/// `batch`'s header around another records area, with `attributes`, `count` and
/// `lastOffsetDelta` as given and the CRC made right: what a client could send.
fn reframe(batch: &[u8], area: &[u8], attributes: i16, count: i32) -> BytesMut {
    let mut buf = BytesMut::from(&batch[..BATCH_HEADER_LEN]);
    buf.extend_from_slice(area);
    let len = (buf.len() - BATCH_LOG_OVERHEAD) as i32;
    buf[8..12].copy_from_slice(&len.to_be_bytes());
    buf[ATTRIBUTES_OFFSET..ATTRIBUTES_OFFSET + 2].copy_from_slice(&attributes.to_be_bytes());
    buf[23..27].copy_from_slice(&(count - 1).to_be_bytes());
    buf[57..61].copy_from_slice(&count.to_be_bytes());
    seal(&mut buf);
    buf
}

fn three() -> BytesMut {
    encode(
        &[
            rec(1000, Some(b"a"), b"one"),
            rec(1500, Some(b"b"), b"two"),
            rec(1200, None, b"three"),
        ],
        ProducerInfo::NONE,
    )
}

#[test]
fn whole_validation_accepts_what_the_encoder_writes() {
    let buf = three();
    let (h, decoded) = validate_whole(&buf).unwrap();
    assert_eq!(decoded, buf.len(), "uncompressed: the batch itself");
    assert_eq!(h.record_count, 3);
    assert_eq!(h.max_timestamp, 1500);
}

#[test]
fn a_right_crc_around_unreadable_records_is_refused() {
    let buf = three();
    let area = &buf[BATCH_HEADER_LEN..];
    // The first record claims more bytes than the batch holds (the batch that
    // stopped the gateway from starting).
    let mut bad = area.to_vec();
    bad[0] = 0x7e;
    let lie = reframe(&buf, &bad, 0, 3);
    assert!(validate(&lie).is_ok(), "the old check let it through");
    assert_eq!(
        validate_whole(&lie),
        Err(BatchError::MalformedRecord {
            index: 0,
            what: "length past end of batch"
        })
    );
    assert!(decode_records(&lie.freeze()).is_err());
}

#[test]
fn the_declared_count_must_be_the_records_there() {
    let buf = three();
    let area = &buf[BATCH_HEADER_LEN..];
    // No records at all behind a count of 2^31-1 (61 bytes that once moved the next
    // offset by two billion).
    let empty = reframe(&buf, &[], 0, i32::MAX);
    assert!(matches!(
        validate_whole(&empty),
        Err(BatchError::MalformedRecord { index: 0, .. })
    ));
    assert!(matches!(
        validate_whole(&reframe(&buf, area, 0, 4)),
        Err(BatchError::MalformedRecord { index: 3, .. })
    ));
    assert_eq!(
        validate_whole(&reframe(&buf, area, 0, 2)),
        Err(BatchError::MalformedRecord {
            index: 2,
            what: "bytes after the last record"
        })
    );
}

#[test]
fn offset_deltas_must_run_in_sequence_and_max_timestamp_must_be_the_newest() {
    // Records whose offset deltas are 0, 2 (encoded by hand: the encoder numbers them).
    let mut area = BytesMut::new();
    for (i, delta) in [0i64, 2].into_iter().enumerate() {
        let r = rec(1000 + i as i64, None, b"v");
        let body = record_body_len(&r, i as i64, delta);
        put_record_head(&mut area, body, (i as i64, delta), None, 1);
        area.put_slice(b"v");
        put_headers(&mut area, &r.headers);
    }
    let buf = three();
    assert_eq!(
        validate_whole(&reframe(&buf, &area, 0, 2)),
        Err(BatchError::MalformedRecord {
            index: 1,
            what: "offset delta out of sequence"
        })
    );
    let mut late = three();
    late[35..43].copy_from_slice(&9999i64.to_be_bytes());
    seal(&mut late);
    assert_eq!(
        validate_whole(&late),
        Err(BatchError::BadMaxTimestamp {
            declared: 9999,
            actual: 1500
        })
    );
    // With LogAppendTime the broker's time stands for every record.
    late[ATTRIBUTES_OFFSET + 1] |= 0x08;
    seal(&mut late);
    assert!(validate_whole(&late).is_ok());
}

#[test]
fn control_batches_and_unknown_codecs_are_refused() {
    let mut control = three();
    control[ATTRIBUTES_OFFSET + 1] |= 0x20;
    seal(&mut control);
    assert_eq!(validate_whole(&control), Err(BatchError::ControlBatch));
    let buf = three();
    let odd = reframe(&buf, &buf[BATCH_HEADER_LEN..], 6, 3);
    assert_eq!(
        validate_whole(&odd),
        Err(BatchError::UnknownCompression { id: 6 })
    );
}

#[test]
fn compressed_batches_validate_and_decode_like_plain_ones() {
    use std::io::Write;
    let plain = three();
    let area = &plain[BATCH_HEADER_LEN..];
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    gz.write_all(area).unwrap();
    let packed = reframe(&plain, &gz.finish().unwrap(), 1, 3);
    assert_eq!(
        BatchHeader::parse(&packed).unwrap().compression(),
        Compression::Gzip
    );
    let (_, decoded) = validate_whole(&packed).unwrap();
    assert_eq!(
        decoded,
        packed.len() + area.len(),
        "the batch and its records decompressed"
    );
    let want = decode_records(&plain.clone().freeze()).unwrap();
    assert_eq!(decode_records(&packed.clone().freeze()).unwrap(), want);
    // Compressed records that do not decompress, or decompress to garbage, are refused.
    let garbage = reframe(&packed, b"not gzip at all", 1, 3);
    assert!(matches!(
        validate_whole(&garbage),
        Err(BatchError::Decompress { .. })
    ));
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    gz.write_all(&area[..area.len() - 2]).unwrap();
    let short = reframe(&packed, &gz.finish().unwrap(), 1, 3);
    assert!(matches!(
        validate_whole(&short),
        Err(BatchError::MalformedRecord { index: 2, .. })
    ));
}

proptest! {
    #[test]
    fn roundtrip_any_records(
        items in proptest::collection::vec(
            (any::<i32>(), proptest::option::of(proptest::collection::vec(any::<u8>(), 0..40)),
             proptest::collection::vec(any::<u8>(), 0..300)),
            1..20)
    ) {
        let records: Vec<Record> = items.iter().map(|(ts, k, v)| Record {
            timestamp: i64::from(*ts),
            key: k.clone().map(Bytes::from),
            value: Some(Bytes::from(v.clone())),
            headers: vec![],
        }).collect();
        // The length a producer reserves file space for is the batch's.
        let mut told = 0;
        let buf = encode_at(&records, ProducerInfo::NONE, |len| {
            told = len;
            None
        })
        .freeze();
        prop_assert_eq!(told, buf.len());
        prop_assert!(validate(&buf).is_ok());
        prop_assert!(validate_whole(&buf).is_ok());
        let decoded = decode_records(&buf).unwrap();
        prop_assert_eq!(decoded.len(), records.len());
        for (i, d) in decoded.iter().enumerate() {
            prop_assert_eq!(d.offset, i as i64);
            prop_assert_eq!(&d.record, &records[i]);
        }
    }

    #[test]
    fn decoding_garbage_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..200)) {
        let _ = validate(&bytes);
        let _ = validate_whole(&bytes);
        let _ = decode_records(&Bytes::from(bytes));
    }

    #[test]
    fn whatever_validates_whole_decodes_whole(
        flips in proptest::collection::vec((0usize..64, any::<u8>()), 1..4)
    ) {
        let mut buf = three();
        for (at, byte) in flips {
            let at = BATCH_HEADER_LEN + at % (buf.len() - BATCH_HEADER_LEN);
            buf[at] = byte;
        }
        seal(&mut buf);
        if let Ok((header, _)) = validate_whole(&buf) {
            let decoded = decode_records(&buf.freeze()).unwrap();
            prop_assert_eq!(decoded.len(), header.record_count as usize);
        }
    }
}
