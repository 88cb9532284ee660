import java.io.File;
import java.nio.ByteBuffer;
import java.time.Duration;
import java.util.List;
import java.util.Properties;
import java.util.UUID;
import org.apache.avro.Schema;
import org.apache.avro.generic.GenericData;
import org.apache.avro.generic.GenericRecord;
import org.apache.avro.message.BinaryMessageDecoder;
import org.apache.avro.message.BinaryMessageEncoder;
import org.apache.kafka.clients.consumer.ConsumerRecord;
import org.apache.kafka.clients.consumer.KafkaConsumer;
import org.apache.kafka.clients.producer.KafkaProducer;
import org.apache.kafka.clients.producer.ProducerRecord;
import org.apache.kafka.common.serialization.ByteArrayDeserializer;
import org.apache.kafka.common.serialization.ByteArraySerializer;
import org.apache.kafka.common.serialization.StringDeserializer;
import org.apache.kafka.common.serialization.StringSerializer;

/**
 * A Java application that submits a task to stepstream and follows it to its end, as docs/producing.md
 * describes: the Kafka Java client at its defaults, Avro's own single-object encoder and decoder, and the
 * schema files of schemas/avro. Nothing of stepstream's code.
 *
 * <p>Arguments: bootstrap servers, topic prefix, the schemas folder, task id, workflow, version, input (JSON),
 * submitter. Prints each status the scheduler reports on the submitter's reply topic; exits 0 once the task
 * completed, 1 if it ended otherwise, 2 if nothing final came within 90 s.
 */
public class SubmitFromJava {
    public static void main(String[] args) throws Exception {
        String bootstrap = args[0], prefix = args[1], taskId = args[3], submitter = args[7];
        File schemas = new File(args[2]);
        Schema submit = new Schema.Parser().parse(new File(schemas, "stepstream.SubmitTask.v4.avsc"));
        GenericRecord task = new GenericData.Record(submit);
        task.put("message_id", UUID.randomUUID().toString());
        task.put("task_id", taskId);
        task.put("occurred_at", System.currentTimeMillis());
        task.put("workflow", args[4]);
        task.put("workflow_version", Long.parseLong(args[5]));
        task.put("input", args[6]);
        task.put("submitter", submitter);
        byte[] value = bytes(new BinaryMessageEncoder<GenericRecord>(GenericData.get(), submit).encode(task));

        Properties producing = new Properties();
        producing.put("bootstrap.servers", bootstrap);
        try (KafkaProducer<String, byte[]> producer =
                 new KafkaProducer<>(producing, new StringSerializer(), new ByteArraySerializer())) {
            producer.send(new ProducerRecord<>(prefix + "inbox", taskId, value)).get();
        }

        Schema status = new Schema.Parser().parse(new File(schemas, "stepstream.StatusUpdate.v1.avsc"));
        BinaryMessageDecoder<GenericRecord> decoder = new BinaryMessageDecoder<>(GenericData.get(), status);
        Properties reading = new Properties();
        reading.put("bootstrap.servers", bootstrap);
        reading.put("group.id", "java-submitter-" + UUID.randomUUID());
        reading.put("auto.offset.reset", "earliest");
        reading.put("metadata.max.age.ms", "500");  // the reply topic is made by the scheduler, maybe after this
        try (KafkaConsumer<String, byte[]> consumer =
                 new KafkaConsumer<>(reading, new StringDeserializer(), new ByteArrayDeserializer())) {
            consumer.subscribe(List.of(prefix + "status." + submitter));
            long deadline = System.currentTimeMillis() + 90_000;
            while (System.currentTimeMillis() < deadline) {
                for (ConsumerRecord<String, byte[]> record : consumer.poll(Duration.ofMillis(200))) {
                    GenericRecord update = decoder.decode(record.value());
                    if (!taskId.equals(update.get("task_id").toString())) {
                        continue;
                    }
                    String state = update.get("status").toString();
                    System.out.println(taskId + " " + state);
                    if (List.of("completed", "error", "compensated", "compensation_failed", "rejected")
                            .contains(state)) {
                        System.exit(state.equals("completed") ? 0 : 1);
                    }
                }
            }
        }
        System.exit(2);
    }

    private static byte[] bytes(ByteBuffer buffer) {
        byte[] out = new byte[buffer.remaining()];
        buffer.get(out);
        return out;
    }
}
