use super::*;

const ORDER: &str = r#"
        sub_type = "header:subtype"

        [[sequence]]
        name = "order"
        retention = "30d"

        [[sequence.type]]
        name = "OrderCreated"
        context_id = "json:/orderId"

        [[sequence.type]]
        name = "OrderValidated"
        sub_type = "stock"
        context_id = "json:/orderId"
        release = { predecessor = "OrderCreated" }

        [[sequence.type]]
        name = "OrderValidated"
        sub_type = "payment"
        context_id = "json:/orderId"
        release = { predecessor = "OrderCreated" }

        [[sequence.type]]
        name = "OrderShipped"
        context_id = "json:/orderId"
        filter = { pointer = "/express", equals = false }
        release = { all = [{ predecessor = "OrderValidated/stock" }, { predecessor = "OrderValidated/payment" }] }
    "#;

fn error_of(text: &str) -> String {
    InboxConfig::from_toml(text).unwrap_err().to_string()
}

#[test]
fn the_order_sequence_parses_and_its_conditions_hold_in_order() {
    let config = InboxConfig::from_toml(ORDER).unwrap();
    let order = &config.sequences[0];
    assert_eq!(order.retention, Duration::from_secs(30 * 86_400));
    let shipped = order.types.iter().find(|t| t.qualified.name == "OrderShipped").unwrap();
    let release = shipped.release.as_ref().unwrap();
    let mut done: HashSet<QualifiedType> = [QualifiedType::new("OrderCreated")].into();
    assert!(!release.holds(&done));
    done.insert(QualifiedType::with_sub_type("OrderValidated", "stock"));
    assert!(!release.holds(&done));
    done.insert(QualifiedType::with_sub_type("OrderValidated", "payment"));
    assert!(release.holds(&done));
    let filter = shipped.filter.as_ref().unwrap();
    assert!(filter.accepts(&Message::new("t", 0, 0, br#"{"orderId":"o1","express":false}"#.to_vec())));
    assert!(!filter.accepts(&Message::new("t", 0, 0, br#"{"orderId":"o1","express":true}"#.to_vec())));
    let context = &shipped.context_id;
    assert_eq!(context.extract(&Message::new("t", 0, 0, br#"{"orderId":42}"#.to_vec())).as_deref(), Some("42"));
    assert_eq!(context.extract(&Message::new("t", 0, 0, br#"{"other":1}"#.to_vec())), None);
}

#[test]
fn nested_conditions_and_recording_parse() {
    let nested = ORDER
            .replace(
                r#"release = { all = [{ predecessor = "OrderValidated/stock" }, { predecessor = "OrderValidated/payment" }] }"#,
                r#"release = { all = [{ predecessor = "OrderValidated/stock" }, { any = [{ predecessor = "OrderCreated" }] }] }"#,
            )
            .replace("retention = \"30d\"", "retention = \"30d\"\nrecord_until = 2026-12-01T01:00:00+01:00");
    let config = InboxConfig::from_toml(&nested).unwrap();
    let order = &config.sequences[0];
    let midnight = SystemTime::UNIX_EPOCH + Duration::from_secs(1_796_083_200); // 2026-12-01T00:00:00Z
    assert_eq!(order.record_until, Some(midnight));
    assert!(order.recording(midnight - Duration::from_secs(1)));
    assert!(!order.recording(midnight));
    let shipped = order.types.iter().find(|t| t.qualified.name == "OrderShipped").unwrap();
    let done: HashSet<QualifiedType> =
        [QualifiedType::new("OrderCreated"), QualifiedType::with_sub_type("OrderValidated", "stock")].into();
    assert!(shipped.release.as_ref().unwrap().holds(&done));
    let local = nested.replace("2026-12-01T01:00:00+01:00", "2026-12-01");
    assert!(error_of(&local).contains("needs a date, a time and an offset"), "{}", error_of(&local));
}

#[test]
fn validation_names_the_problem() {
    let one_type = r#"[[sequence]]
            name = "s"
            retention = "1d"
            [[sequence.type]]
            name = "A"
            context_id = "json:/id""#;
    assert!(error_of(one_type).contains("two or more"), "{}", error_of(one_type));

    let missing = ORDER.replace(r#"predecessor = "OrderCreated" }"#, r#"predecessor = "OrderOpened" }"#);
    assert!(error_of(&missing).contains("`OrderOpened`, which is not a message type"), "{}", error_of(&missing));

    let cycle = r#"[[sequence]]
            name = "s"
            retention = "1d"
            [[sequence.type]]
            name = "A"
            context_id = "json:/id"
            release = { predecessor = "B" }
            [[sequence.type]]
            name = "B"
            context_id = "json:/id"
            release = { any = [{ predecessor = "A" }] }"#;
    assert!(error_of(cycle).contains("circle"), "{}", error_of(cycle));

    let twice = format!("{ORDER}\n{}", ORDER.replace(r#"name = "order""#, r#"name = "other""#));
    assert!(error_of(&twice).contains("at most one sequence"), "{}", error_of(&twice));

    let mixed =
        ORDER.replace("name = \"OrderShipped\"\n        context_id", "name = \"OrderValidated\"\n        context_id");
    assert!(error_of(&mixed).contains("with sub-types and also without"), "{}", error_of(&mixed));

    // Every such type is named, in order (not one chosen by hash order).
    let both_mixed = r#"sub_type = "header:subtype"
            [[sequence]]
            name = "s"
            retention = "1d"
            [[sequence.type]]
            name = "B"
            context_id = "json:/id"
            [[sequence.type]]
            name = "B"
            sub_type = "y"
            context_id = "json:/id"
            [[sequence.type]]
            name = "A"
            context_id = "json:/id"
            [[sequence.type]]
            name = "A"
            sub_type = "x"
            context_id = "json:/id""#;
    for _ in 0..10 {
        let error = error_of(both_mixed);
        assert!(error.contains("message types `A`, `B` are declared with sub-types and also without"), "{error}");
    }

    let bad_condition = ORDER.replace(r#"release = { predecessor = "OrderCreated" }"#, "release = {}");
    assert!(error_of(&bad_condition).contains("exactly one of"), "{}", error_of(&bad_condition));

    let bad_context = ORDER.replace(r#"context_id = "json:/orderId""#, r#"context_id = "orderId""#);
    assert!(error_of(&bad_context).contains("context_id"), "{}", error_of(&bad_context));

    let unknown = ORDER.replace("retention = \"30d\"", "retention = \"30d\"\nretain = 1");
    assert!(error_of(&unknown).contains("retain"), "{}", error_of(&unknown));
}
